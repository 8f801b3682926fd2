"""CPU backend: worker threads copy chunks into the slot mapping and checksum each while it is warm."""
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Sequence

import numpy as np
import torch

from hpcft.snapshot.plan import Chunk
from hpcft.store import Slot, crc32c


class CpuTransfer:
    """Futures of the worker threads; the result is the per-chunk crc list."""

    def __init__(self, futures: list[Future], nchunks: int):
        self._futures = futures
        self._n = nchunks

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def result(self, timeout: float | None = None) -> list[int]:
        crcs = [0] * self._n
        for f in self._futures:
            for i, c in f.result(timeout):
                crcs[i] = c
        return crcs


class CpuCopier:
    """`threads` workers, each taking every threads-th chunk. With `overlap` the copy runs while training
    continues and the pre-step hook joins it; without, `start` returns once the bytes are copied (on a CPU
    whose cores all compute, overlapping only makes the copy and the step fight for the same cores).
    `delay_per_chunk` (seconds) slows each chunk down, for tests that need a wide copy window."""

    name = "cpu"
    # Small enough that a chunk just copied is still in L2 (2 MiB here) when it is checksummed, and on
    # restore still there when it is copied after its check; large enough that the per-chunk Python and
    # GIL hand-offs stay few. Copy + crc32c of 600 MB with 2 threads: 0.9-1.0x memcpy with 256 KiB-1 MiB
    # chunks, 0.85x with 4 MiB; 256 KiB suffered most when the cores were oversubscribed.
    chunk_bytes = 1 << 20

    def __init__(self, threads: int = 2, delay_per_chunk: float = 0.0, overlap: bool = True):
        self.threads = max(1, threads)
        self.delay_per_chunk = delay_per_chunk
        self.overlap = overlap
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="hpcft-copy")

    def start(self, sources: Sequence[torch.Tensor], chunks: Sequence[Chunk], slot: Slot) -> CpuTransfer:
        arrays = [s.numpy() for s in sources]
        dst = slot.array
        futures = [self._pool.submit(self._work, arrays, chunks, dst, range(t, len(chunks), self.threads))
                   for t in range(min(self.threads, len(chunks)) or 1)]
        if not self.overlap:
            wait(futures)  # errors stay in the futures: the commit thread reports them
        return CpuTransfer(futures, len(chunks))

    def _work(self, arrays: list[np.ndarray], chunks: Sequence[Chunk], dst: np.ndarray,
              which: range) -> list[tuple[int, int]]:
        out = []
        for i in which:
            chunk = chunks[i]
            for s in chunk.segments:
                np.copyto(dst[s.offset:s.offset + s.nbytes], arrays[s.source][s.start:s.start + s.nbytes])
            if self.delay_per_chunk:
                time.sleep(self.delay_per_chunk)
            out.append((i, crc32c(dst[chunk.offset:chunk.offset + chunk.nbytes])))
        return out

    def guard(self, transfer: CpuTransfer) -> None:
        transfer.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
