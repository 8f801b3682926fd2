"""What every `hpcft bench` shares: interleaved timing, medians, a memcpy reference, scratch dirs, output.

A bench builds `Variant`s, lets `run_interleaved` time them round-robin in blocks (so drift in a
shared machine hits all alike), and reports ratios in a `Report`: one JSON object on stdout with
`--json` (the table then goes to stderr), else the table on stdout.
"""
from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import socket
import statistics
import sys
import tempfile
import time
from collections import namedtuple
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hpcft.errors import ConfigError

_log = logging.getLogger(__name__)

GB = 1e9


class Variant:
    """One way of running the timed body (e.g. "train step + torch.save"); subclasses fill in the hooks."""

    name = "variant"

    def prepare(self, index: int) -> None:
        """Untimed set-up before call `index` (e.g. perturb the state a restore must bring back)."""

    def run_once(self, index: int) -> None:
        """The timed body; `index` counts calls to this variant from 0 (warmup included)."""
        raise NotImplementedError

    def check(self, index: int) -> None:
        """Untimed check after call `index` (and its drain); raises when the outcome is wrong."""

    def drain(self) -> None:
        """Finish work left in the background before another variant runs; timed with the last call."""

    def close(self) -> None:
        """Release what the variant holds; not timed."""


@dataclass
class Timings:
    """Per-variant wall times and process CPU times (all threads) of the measured calls (warmup excluded)."""

    samples: dict[str, list[float]] = field(default_factory=dict)
    cpu_samples: dict[str, list[float]] = field(default_factory=dict)

    def median(self, name: str) -> float:
        return statistics.median(self.samples[name])

    def cpu_median(self, name: str) -> float:
        return statistics.median(self.cpu_samples[name])

    def summary(self, name: str) -> dict[str, float]:
        """Median, quartiles and count of one variant's samples, for the JSON."""
        xs = sorted(self.samples[name])
        q = statistics.quantiles(xs, n=4) if len(xs) >= 2 else [xs[0]] * 3
        cpu = self.cpu_samples.get(name)
        return {"median_s": statistics.median(xs), "p25_s": q[0], "p75_s": q[2], "n": len(xs),
                "median_cpu_s": statistics.median(cpu) if cpu else None}


def run_interleaved(variants: Sequence[Variant], steps: int, warmup: int = 1, block: int = 2,
                    clock: Callable[[], float] = time.perf_counter,
                    cpu_clock: Callable[[], float] = time.process_time, close: bool = False) -> Timings:
    """Time `warmup + steps` calls of every variant, round-robin in blocks of `block` calls; `close`: close every
    variant afterwards, also after a failure.

    A variant's background work still pending at the end of its block (`drain`) is charged to the
    block's last call: that is the wait its next call would have had. Besides wall time, the process's
    CPU time (all its threads) is recorded: on a machine shared with other work it is the steadier cost.
    """
    if steps < 1 or warmup < 0 or block < 1:
        raise ConfigError(f"need steps >= 1, warmup >= 0, block >= 1 (got {steps}, {warmup}, {block})")
    timings = Timings({v.name: [] for v in variants}, {v.name: [] for v in variants})
    done = {v.name: 0 for v in variants}
    total = warmup + steps
    try:
        while any(done[v.name] < total for v in variants):
            for v in variants:
                n = min(block, total - done[v.name])
                for k in range(n):
                    index = done[v.name]
                    v.prepare(index)
                    t0, c0 = clock(), cpu_clock()
                    v.run_once(index)
                    if k == n - 1:
                        v.drain()
                    elapsed, cpu = clock() - t0, cpu_clock() - c0
                    v.check(index)
                    done[v.name] += 1
                    if index >= warmup:
                        timings.samples[v.name].append(elapsed)
                        timings.cpu_samples[v.name].append(cpu)
                    _log.debug("bench %s call %d: %.4f s", v.name, index, elapsed)
    finally:
        for v in variants if close else ():
            v.close()
    return timings


def overhead(timings: Timings, name: str, baseline: str, cpu: bool = False) -> float:
    """Median wall time of `name` ÷ median wall time of `baseline`, minus 1; `cpu`: with process CPU time, what the
    variant costs in core-seconds whatever else the machine runs."""
    median = timings.cpu_median if cpu else timings.median
    return median(name) / median(baseline) - 1.0


class Memcpy(Variant):
    """A plain memcpy (numpy.copyto, which releases the GIL) of `nbytes` between pre-faulted buffers, split over
    `threads` threads as hpcft splits its copy: the reference a bench interleaves with what it measures, so load
    from other processes hits both alike."""

    name = "memcpy"

    def __init__(self, nbytes: int, threads: int = 1, src: np.ndarray | None = None,
                 dst: np.ndarray | None = None) -> None:
        self.nbytes, self.threads = nbytes, max(1, threads)
        self._cuts = np.linspace(0, nbytes, self.threads + 1, dtype=np.int64)
        self._pool = ThreadPoolExecutor(self.threads - 1) if self.threads > 1 else None
        # written now, so no page faults in the timed copies
        self.src = np.ones(nbytes, dtype=np.uint8) if src is None else src
        self.dst = np.ones(nbytes, dtype=np.uint8) if dst is None else dst

    def _part(self, i: int) -> None:
        lo, hi = self._cuts[i], self._cuts[i + 1]
        np.copyto(self.dst[lo:hi], self.src[lo:hi])

    def run_once(self, index: int) -> None:
        others = [self._pool.submit(self._part, i) for i in range(1, self.threads)] if self._pool else []
        self._part(0)
        for f in others:
            f.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
        self.src = self.dst = np.empty(0, dtype=np.uint8)


class StoreMemcpy(Memcpy):
    """The same memcpy out of a store data file's own shared mapping into memory from torch's allocator: the restore's
    reference on the memory it really reads and writes (the store's pages: 4 KiB on a tmpfs without huge pages, where
    `Memcpy`'s numpy buffers get 2 MiB pages from transparent huge pages). `fresh`: every call maps the file anew, as
    a relaunched process does, and the copy faults its pages in (unmapped again untimed, before the next call)."""

    def __init__(self, path: Path, nbytes: int, threads: int = 1, fresh: bool = False) -> None:
        import torch

        self._tensor = torch.ones(nbytes, dtype=torch.uint8)  # written now: no page faults on this side
        super().__init__(nbytes, threads, np.empty(0, dtype=np.uint8), self._tensor.numpy())
        self.name = "memcpy_shm_fresh" if fresh else "memcpy_shm"
        self.path, self.fresh, self._mm = path, fresh, None
        self._map()

    def _map(self) -> None:
        with open(self.path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), self.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        self.src = np.frombuffer(self._mm, dtype=np.uint8)
        if not self.fresh:
            self.src[::mmap.PAGESIZE].sum()  # every page in this mapping's page table, once

    def _unmap(self) -> None:
        self.src = np.empty(0, dtype=np.uint8)
        if self._mm is not None:
            self._mm.close()
            self._mm = None

    def prepare(self, index: int) -> None:
        if self.fresh:
            self._unmap()

    def run_once(self, index: int) -> None:
        if self.fresh:
            self._map()
        super().run_once(index)

    def close(self) -> None:
        super().close()
        self._unmap()
        self._tensor = None


class DeviceCopy(Variant):
    """The GPU reference: one copy of `nbytes` between device memory and pinned host memory, waited for
    (cudaMemcpy/hipMemcpy through torch): the fastest way a snapshot's bytes can leave the device (device→host) or a
    restore's reach it (`to_device`)."""

    name = "memcpy"

    def __init__(self, nbytes: int, device: str, to_device: bool = False) -> None:
        import torch

        self.nbytes = nbytes
        self.device = torch.device(device)
        on_device = torch.ones(nbytes, dtype=torch.uint8, device=self.device)
        pinned = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
        self.src, self.dst = (pinned, on_device) if to_device else (on_device, pinned)

    def run_once(self, index: int) -> None:
        import torch

        self.dst.copy_(self.src, non_blocking=True)
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.src = self.dst = None


def memcpy_reference(nbytes: int, device: str = "cpu", threads: int = 1, to_device: bool = False) -> Variant:
    """The bandwidth reference for a state on `device`: host memcpy with `threads` threads on a CPU; on a GPU the copy
    between the device and pinned host memory, device→host (a snapshot) or host→device (`to_device`, a restore)."""
    return Memcpy(nbytes, threads) if device == "cpu" else DeviceCopy(nbytes, device, to_device)


@contextlib.contextmanager
def local_process_group() -> Iterator[None]:
    """A 1-rank gloo process group on a free loopback port (DCP needs one); reuses an existing group."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:  # a port on 127.0.0.1 that was free a moment ago
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True)
class Scratch:
    """Where a bench writes: `disk` for file-based baselines, `shm` for the hpcft store."""

    disk: Path
    shm: Path


@contextlib.contextmanager
def scratch(root: str | os.PathLike | None = None) -> Iterator[Scratch]:
    """Fresh temp dirs for a bench (store dir under `root`, default /dev/shm), removed afterwards."""
    shm_parent = Path(root) if root else Path("/dev/shm")
    if not shm_parent.is_dir():
        raise ConfigError(f"--root {shm_parent} is not a directory; give an existing directory (e.g. /dev/shm)")
    with tempfile.TemporaryDirectory(prefix="hpcft-bench-", ignore_cleanup_errors=True) as disk, \
            tempfile.TemporaryDirectory(prefix="hpcft-bench-", dir=shm_parent, ignore_cleanup_errors=True) as shm:
        yield Scratch(disk=Path(disk), shm=Path(shm))


def set_threads(threads: int) -> None:
    """Set torch's intra-op thread count (the CPU bench's compute cores)."""
    import torch

    torch.set_num_threads(threads)


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send everything written to fd 1 (Python or C++ libraries) to stderr, so --json stays one object."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


Row = namedtuple("Row", "key value unit label")


class Report:
    """The result of one bench: keyed values for the JSON, the labelled ones also as table rows."""

    def __init__(self, bench: str, judge: Callable[[dict[str, Any]], dict[str, bool]] | None = None) -> None:
        self.bench = bench
        self.rows: list[Row] = []
        self.extra: dict[str, Any] = {}
        self.judge = judge  # figures -> {target: met}: under "met", from the medians when runs are combined

    def add(self, key: str, value: Any, unit: str = "", label: str = "") -> None:
        """A result value; with a `label` it is also a table row."""
        self.rows.append(Row(key, value, unit, label))

    def note(self, key: str, value: Any) -> None:
        """JSON-only detail (configuration, per-variant quartiles)."""
        self.extra[key] = value

    def as_dict(self) -> dict[str, Any]:
        out = {"bench": self.bench, **{r.key: r.value for r in self.rows}, **self.extra}
        if self.judge is not None:
            out["met"] = self.judge(out)
        return out

    def table(self) -> str:
        rows = [r for r in self.rows if r.label]
        width = max((len(r.label) for r in rows), default=0)
        lines = [f"hpcft bench {self.bench}"]
        lines += [f"  {r.label:<{width}}  {_fmt(r.value, r.unit)}" for r in rows]
        return "\n".join(lines)


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One report from repeated runs of a bench: each numeric figure is the median over the runs, with its
    spread (min, max) under `spread`; a true/false figure (`identical`, `verified`) is true only if it is in every
    run; everything else is the first run's; every run is kept under `runs`."""
    out = dict(runs[0])
    spread = {}
    for key, value in runs[0].items():
        values = [r.get(key) for r in runs]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and \
                all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            out[key] = statistics.median(values)
            spread[key] = [min(values), max(values)]
        elif isinstance(value, bool):
            out[key] = all(v is True for v in values)
    out.update({"repeats": len(runs), "spread": spread, "runs": runs})
    return out


def _fmt(value: Any, unit: str) -> str:
    if isinstance(value, float):
        if unit == "%":
            return f"{100 * value:+.1f} %"
        if unit == "x":
            return f"{value:.2f}x"
        return f"{value:.4g} {unit}".rstrip()
    return f"{value} {unit}".rstrip()


def emit(report: Report | Sequence[Report], as_json: bool, machine: dict[str, Any] | None = None) -> None:
    """--json: one JSON object on stdout and the tables on stderr; else the tables on stdout. Several reports
    (repeated runs) become one object of medians with their spread (`combine`); `machine` is recorded
    under its own key."""
    reports = [report] if isinstance(report, Report) else list(report)
    tables = "\n".join(r.table() for r in reports)
    if machine:
        tables += "\n  machine: " + ", ".join(f"{k} {v}" for k, v in machine.items())
    if as_json:
        print(tables, file=sys.stderr)
        out = reports[0].as_dict() if len(reports) == 1 else combine([r.as_dict() for r in reports])
        if len(reports) > 1 and reports[0].judge is not None:
            out["met"] = reports[0].judge(out)  # the targets are met by the medians, not by the first run
        if machine:
            out["machine"] = machine
        print(json.dumps(out), flush=True)
    else:
        print(tables)
