"""What a bench ran on, measured in the same run: a figure from one machine does not carry over to another of the
same kind (ratios fell by a third between two boxes of this project's kind), so every report names its CPU, its
cores, its memory and the memory bandwidth it had, and the load it shared the machine with."""
from __future__ import annotations

import os
import platform
from dataclasses import asdict
from typing import Any

from hpcft.bench.harness import GB, Memcpy, run_interleaved
from hpcft.env import usable_cores
from hpcft.snapshot.calibration import CopySettings
from hpcft.snapshot.calibration.cache import cpu_model


def memcpy_gbps(threads: int, nbytes: int = 256 << 20, repeats: int = 3) -> float:
    """Best of `repeats` copies of `nbytes` between pre-faulted buffers with `threads` threads, in GB/s."""
    timings = run_interleaved([Memcpy(nbytes, threads)], repeats, warmup=0, block=repeats, close=True)
    return round(nbytes / min(timings.samples["memcpy"]) / GB, 2)


def describe(threads: int = 2) -> dict[str, Any]:
    """The machine as a bench report records it (measuring its bandwidth takes about a second)."""
    memory_gib = round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30, 1)
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "usable_cores": usable_cores(), "memory_gib": memory_gib,
            "memcpy_gbps_1_thread": memcpy_gbps(1), f"memcpy_gbps_{threads}_threads": memcpy_gbps(threads),
            "load_average": [round(x, 2) for x in os.getloadavg()], "host": platform.node()}


def calibration(settings: CopySettings) -> dict[str, Any]:
    """The copy methods a bench's Checkpointer used and where they came from, with the calibration's measurements
    (case, kernel, threads, chunk bytes, GB/s) where it measured any."""
    got = settings.resolved
    out: dict[str, Any] = {"snapshot": asdict(settings.snapshot), "restore": asdict(settings.restore)}
    if got is not None:
        out.update(source=got.source, detail=got.detail,
                   samples=[[s.case, s.method.kernel, s.method.threads, s.method.chunk_bytes,
                             round(s.gbps, 2) if s.gbps else None] for s in got.samples])
    return out
