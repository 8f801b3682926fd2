"""Measure the candidate copy methods the way hpcft copies: chunks of a buffer larger than the last-level cache, each
copied and checksummed (ntcopy.raw_copy_crc), taken from one counter by the calling thread and `threads - 1` pool
threads. Three cases: a snapshot (host memory → a pre-faulted /dev/shm mapping), a restore (back) and a relaunch's
cold restore (a fresh mapping whose pages fault in as they are read)."""
from __future__ import annotations

import itertools
import mmap
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from hpcft.snapshot.calibration.policy import CASES, DEFAULT_CHUNK, Method, Sample, best_per_chunk
from hpcft.store import ntcopy

CHUNKS = (256 << 10, DEFAULT_CHUNK, 4 << 20)
REPEATS = 3  # each figure is the best of these (the least disturbed by other work), candidates interleaved
BUDGET = 1.2  # seconds after which no new round starts (each stage measures at least one round)
MAX_THREADS = 16
BUFFER_RANGE = (64 << 20, 256 << 20)


def thread_counts(cores: int) -> list[int]:
    """1, 2, 4, … below `cores`, and `cores` itself (at most MAX_THREADS): the thread counts worth measuring."""
    top = max(1, min(cores, MAX_THREADS))
    return sorted({*(1 << k for k in range(top.bit_length()) if 1 << k < top), top})


def buffer_bytes() -> int:
    """Twice the last-level cache this CPU reports, within BUFFER_RANGE: no pass finds its source in cache."""
    largest = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
            largest = max(largest, int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0))
        except (OSError, ValueError):
            continue
    n = min(max(2 * largest, BUFFER_RANGE[0]), BUFFER_RANGE[1])
    return n // CHUNKS[-1] * CHUNKS[-1]


class _Buffers:
    """Host memory standing for the state's tensors and a /dev/shm file standing for a slot, both faulted in."""

    def __init__(self, nbytes: int, root: Path):
        self.nbytes = nbytes
        raw = np.ones(nbytes + 64, dtype=np.uint8)
        skip = -ntcopy.address(raw) % 64  # as torch aligns a tensor (and the slot, a page): the copies' lines line up
        self.host = raw[skip:skip + nbytes]
        fd, name = tempfile.mkstemp(prefix=".hpcft-calibration-", dir=root)
        os.unlink(name)  # nothing is left behind, whatever happens
        self._fd = fd
        try:
            os.posix_fallocate(fd, 0, nbytes)
            self._mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except OSError:
            os.close(fd)
            raise
        self.slot = np.frombuffer(self._mm, dtype=np.uint8)
        self.slot[:] = 1

    def cold(self, use: Callable[[np.ndarray], float]) -> float:
        """`use` of a fresh mapping of the slot's file, no page mapped yet (a relaunched reader's)."""
        mm = mmap.mmap(self._fd, self.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        try:
            return use(np.frombuffer(mm, dtype=np.uint8))
        finally:
            mm.close()

    def close(self) -> None:
        del self.slot
        self._mm.close()
        os.close(self._fd)


def copy_pass(copy_crc: Callable[[int, int, int, int], int], dst: np.ndarray, src: np.ndarray, chunk: int,
              threads: int, pool: ThreadPoolExecutor) -> float:
    """Seconds to copy `src` into `dst` chunk by chunk with `copy_crc` (ntcopy.raw_copy_crc), as hpcft copies."""
    d0, s0, count = ntcopy.address(dst), ntcopy.address(src), -(-src.size // chunk)
    take = itertools.count().__next__

    def work() -> None:
        while (i := take()) < count:
            lo = i * chunk
            n = min(chunk, src.size - lo)
            copy_crc(d0 + lo, s0 + lo, n, 0)

    t0 = time.perf_counter()
    others = [pool.submit(work) for _ in range(threads - 1)]
    work()
    for f in others:
        f.result()
    return time.perf_counter() - t0


def _run(buffers: _Buffers, case: str, method: Method, pool: ThreadPoolExecutor) -> float:
    def run(dst: np.ndarray, src: np.ndarray) -> float:
        return copy_pass(ntcopy.raw_copy_crc(method.kernel), dst, src, method.chunk_bytes, method.threads, pool)

    if case in ("snapshot", "restore"):
        return run(buffers.slot, buffers.host) if case == "snapshot" else run(buffers.host, buffers.slot)
    return buffers.cold(lambda fresh: run(buffers.host, fresh))


def _timed(buffers: _Buffers, plan: Sequence[tuple[str, Method]], repeats: int, pool: ThreadPoolExecutor,
           budget: float) -> list[Sample]:
    """The best of up to `repeats` rounds of each (case, method), the candidates interleaved within each round; no
    round is started after `budget` seconds (a loaded machine measures less, never longer), the first always is."""
    best = {p: float("inf") for p in plan}
    t0 = time.perf_counter()
    for r in range(repeats):
        if r and time.perf_counter() - t0 > budget:
            break
        for p in plan:
            best[p] = min(best[p], _run(buffers, *p, pool))
    return [Sample(case, m, best[(case, m)], buffers.nbytes) for case, m in plan]


def measure(root: Path, cores: int, *, nbytes: int | None = None, chunks: Sequence[int] = CHUNKS,
            repeats: int = REPEATS, threads: Sequence[int] | None = None, budget: float = BUDGET) -> list[Sample]:
    """Samples of every kernel × thread count at the default chunk in each case, then of each direction's best at
    every chunk size (not the full grid), within about `budget` seconds. The scratch file lives in `root` (the store's
    root: what a slot is made of) and is unlinked at once. OSError where the buffers cannot be had."""
    counts = list(threads or thread_counts(cores))
    cases = [c for cs in CASES.values() for c in cs]
    size = nbytes or buffer_bytes()
    kernels = ntcopy.kernels()
    failed = [Sample(c, Method(k, t, DEFAULT_CHUNK), None, size, _why_not(k))
              for k in ntcopy.KERNELS if k not in kernels for c in cases for t in counts]
    buffers = _Buffers(size, root)
    try:
        with ThreadPoolExecutor(max(1, max(counts) - 1), thread_name_prefix="hpcft-calibrate") as pool:
            first = [(c, Method(k, t, DEFAULT_CHUNK)) for c in cases for k in kernels for t in counts]
            samples = _timed(buffers, first, repeats, pool, budget * 0.6)
            lead = {d: best_per_chunk(samples, d)[DEFAULT_CHUNK][0] for d in CASES}
            # the leaders again at the default size too, interleaved with the other sizes: drift between the two
            # rounds (other work starting or ending) must not decide the size
            second = [(c, Method(lead[d].kernel, lead[d].threads, chunk)) for chunk in sorted({*chunks, DEFAULT_CHUNK})
                      for d, cs in CASES.items() for c in cs]
            samples = _merged(samples + _timed(buffers, second, repeats, pool, budget * 0.4))
    finally:
        buffers.close()
    return failed + samples


def _why_not(kernel: str) -> str:
    """Why `kernel` does not run here (for the samples a calibration could not take)."""
    if not ntcopy.available():
        return ntcopy.reason
    return f"the {kernel} kernel needs an x86-64 CPU with SSE4.2 and AVX2"


def _merged(samples: list[Sample]) -> list[Sample]:
    """One sample per (case, method): the best of those measured, in first-measured order."""
    best: dict[tuple[str, Method], Sample] = {}
    for s in samples:
        old = best.get((s.case, s.method))
        if old is None or s.seconds < old.seconds:
            best[(s.case, s.method)] = s
    return list(best.values())
