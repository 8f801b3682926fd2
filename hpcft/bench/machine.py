"""What a bench ran on, measured in the same run: a figure from one machine does not carry over to another of the
same kind (ratios fell by a third between two boxes of this project's kind), so every report names its CPU, its
cores, its memory and the memory bandwidth it had, and the load it shared the machine with."""
from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any


GB = 1e9


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def memcpy_gbps(threads: int, nbytes: int = 256 << 20, repeats: int = 3) -> float:
    """Best of `repeats` copies of `nbytes` between pre-faulted buffers with `threads` threads, in GB/s."""
    from hpcft.bench.harness import Memcpy

    copy = Memcpy(nbytes, threads)
    try:
        best = float("inf")
        for i in range(repeats):
            t0 = time.perf_counter()
            copy.run_once(i)
            best = min(best, time.perf_counter() - t0)
    finally:
        copy.close()
    return round(nbytes / best / GB, 2)


def describe(threads: int = 2) -> dict[str, Any]:
    """The machine as a bench report records it (measuring its bandwidth takes about a second)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "usable_cores": usable, "memory_gib": _memory_gib(),
            "memcpy_gbps_1_thread": memcpy_gbps(1), f"memcpy_gbps_{threads}_threads": memcpy_gbps(threads),
            "load_average": [round(x, 2) for x in os.getloadavg()], "host": platform.node()}


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One report from repeated runs of a bench: each numeric figure is the median over the runs, with its
    spread (min, max) under `spread`; everything else is the first run's; every run is kept under `runs`."""
    out = dict(runs[0])
    spread = {}
    for key, value in runs[0].items():
        values = [r.get(key) for r in runs]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and \
                all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            out[key] = statistics.median(values)
            spread[key] = [min(values), max(values)]
    out.update({"repeats": len(runs), "spread": spread, "runs": runs})
    return out
