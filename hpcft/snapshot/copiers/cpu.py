"""CPU backend: worker threads copy chunks into the slot mapping and checksum each while it is warm."""
import itertools
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Sequence

import numpy as np
import torch

from hpcft.snapshot import plan
from hpcft.snapshot.copiers.base import SlotClaim
from hpcft.snapshot.plan import Chunk
from hpcft.store import chunk_crc, crc32c, ntcopy


class CpuTransfer:
    """Futures of the worker threads; the result is the per-chunk crc list."""

    def __init__(self, futures: list[Future], nchunks: int, crcs: np.ndarray | None = None):
        self._futures = futures
        self._n = nchunks
        self._crcs = crcs  # where the workers ran the C loop (ntcopy.ChunkCopy): its crcs, the futures return none

    def result(self, timeout: float | None = None) -> list[int]:
        if self._crcs is not None:
            for f in self._futures:
                f.result(timeout)
            return self._crcs.tolist()
        crcs = [0] * self._n
        for f in self._futures:
            for i, c in f.result(timeout):
                crcs[i] = c
        return crcs


class _Job:
    """One snapshot's chunks, each taken by whichever worker is free; each segment copied with streaming stores and
    checksummed in the same pass (ntcopy.raw_copy_crc), the padding between segments checksummed from the slot."""

    def __init__(self, arrays: list[np.ndarray], addrs: list[int], chunks: Sequence[Chunk], dst: np.ndarray,
                 delay: float, kernel: str):
        self.arrays, self.addrs, self.chunks, self.dst, self.delay = arrays, addrs, chunks, dst, delay
        self.copy_crc = ntcopy.raw_copy_crc(kernel)
        self._next = itertools.count().__next__  # atomic under the GIL

    def run(self) -> list[tuple[int, int]]:
        copy_crc, base, dst, addrs, out = self.copy_crc, ntcopy.address(self.dst), self.dst, self.addrs, []

        def padding(lo: int, hi: int, crc: int) -> int:
            return crc32c(dst[lo:hi], crc)

        def segment(s, crc: int) -> int:
            return copy_crc(base + s.offset, addrs[s.source] + s.start, s.nbytes, crc)

        while (i := self._next()) < len(self.chunks):
            crc = chunk_crc(self.chunks[i], padding, segment)
            if self.delay:
                time.sleep(self.delay)
            out.append((i, crc))
        return out


class CpuCopier:
    """`threads` workers taking chunks as they are free. With `overlap` the copy runs while training continues and
    the pre-step hook joins it; without, `start` copies with the training thread as one worker (where every core
    computes, overlap only makes copy and step fight for them). `kernel`: as hpcft.snapshot.calibration chose."""

    name = "cpu"
    checksums = "host"
    # Small enough that a chunk just copied is still in L2 (2 MiB here) when it is checksummed, and on
    # restore still there when it is copied after its check; large enough that the per-chunk Python and
    # GIL hand-offs stay few. Copy + crc32c of 600 MB with 2 threads: 0.9-1.0x memcpy with 256 KiB-1 MiB
    # chunks, 0.85x with 4 MiB; 256 KiB suffered most when the cores were oversubscribed.
    chunk_bytes = 1 << 20

    def __init__(self, threads: int = 2, overlap: bool = True, kernel: str = "fused"):
        self.threads = max(1, threads)
        self.kernel = kernel
        self._delay_per_chunk = 0.0  # seconds slept per chunk: a test's seam for a wide copy window (no C loop then)
        self.overlap = overlap
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="hpcft-copy")
        self._sources: Sequence[torch.Tensor] | None = None
        self._views: tuple[list[np.ndarray], list[int]] = ([], [])
        self._chunk_copy = ntcopy.chunk_copy(kernel)  # the whole copy in C
        self._planned: tuple[Sequence[Chunk], Sequence[torch.Tensor], plan.Table, np.ndarray] | None = None

    def _arrays(self, sources: Sequence[torch.Tensor]) -> tuple[list[np.ndarray], list[int]]:
        """NumPy views of the sources and their addresses, made once per sources list (one per layout)."""
        if sources is not self._sources:
            arrays = [s.numpy() for s in sources]
            self._sources, self._views = sources, (arrays, [ntcopy.address(a) for a in arrays])
        return self._views

    def _plan(self, sources: Sequence[torch.Tensor], chunks: Sequence[Chunk]) -> tuple[plan.Table, np.ndarray]:
        """The chunks' table and each segment's source address, made once per layout (its chunks and sources)."""
        if self._planned is None or self._planned[0] is not chunks or self._planned[1] is not sources:
            table = plan.table_of(chunks)
            addrs = np.array(self._arrays(sources)[1], dtype=np.uint64)
            self._planned = (chunks, sources, table, addrs[table.source.astype(np.intp)] + table.start)
        return self._planned[2], self._planned[3]

    def start(self, sources: Sequence[torch.Tensor], chunks: Sequence[Chunk], claim: SlotClaim) -> CpuTransfer:
        slot, crcs = claim(), None
        if self._chunk_copy is not None and not self._delay_per_chunk:  # a worker's share in one C call, no GIL
            table, addr = self._plan(sources, chunks)
            job = self._chunk_copy(ntcopy.address(slot.array), addr, *table[2:], to_slot=True)
            run, crcs = (lambda: job.run() or []), job.crcs
        else:
            run = _Job(*self._arrays(sources), chunks, slot.array, self._delay_per_chunk, self.kernel).run
        if self.overlap:
            return CpuTransfer([self._pool.submit(run) for _ in range(min(self.threads, len(chunks)) or 1)],
                               len(chunks), crcs)
        # the training thread waits anyway: it copies too, next to threads - 1 pool threads
        futures = [self._pool.submit(run) for _ in range(min(self.threads, len(chunks)) - 1)]
        mine: Future = Future()
        try:
            mine.set_result(run())
        except Exception as exc:  # reported by the commit thread, as a pool thread's would be
            mine.set_exception(exc)
        wait(futures)
        return CpuTransfer(futures + [mine], len(chunks), crcs)

    def guard(self, transfer: CpuTransfer) -> None:
        transfer.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
