"""One reusable data file of the store: allocated once, pre-faulted, mapped shared, grown only if needed."""
import errno
import mmap
import os
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

import numpy as np

from hpcft.errors import StoreError, StoreFullError
from hpcft.store import prefetch
from hpcft.store.paths import open_file

GRAIN = 1 << 20  # sizes are rounded up to this, so small layout changes do not regrow the file
GROW_PIECE = 64 << 20  # allocated between two calls of `ensure`'s pace
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def _round_up(n: int, grain: int = GRAIN) -> int:
    return max(grain, -(-n // grain) * grain)


class Slot:
    """A data file `slot-<k>.data` and its shared mapping; `array` is a uint8 view of all of it."""

    def __init__(self, index: int, path: Path, *, readonly: bool = False, create: bool = True):
        """Open (with `create`, create if missing) the data file; StoreError if it is not a regular file of ours."""
        self.index = index
        self.path = path
        self.readonly = readonly
        self.generation = 0  # bumped whenever the mapping moves (copiers re-register pinned memory)
        self._fd = open_file(path, os.O_RDONLY if readonly else os.O_RDWR, create=create and not readonly)
        self._mm: mmap.mmap | None = None
        self.populated = False  # every page of the mapping is in the page table (MAP_POPULATE, prefetch, a restore)
        self.array = np.empty(0, dtype=np.uint8)
        size = os.fstat(self._fd).st_size
        if size:  # an existing file: mapped as it is read, unless prefetched (read-write, so never for a reader)
            ahead = None if readonly else prefetch.adopt(path, self._fd, size)
            self._map(size, populate=ahead is not None, adopted=ahead)

    @property
    def size(self) -> int:
        return self.array.size

    def ensure(self, nbytes: int, pace: Callable[[], None] | None = None) -> None:
        """Make the file at least `nbytes` long, every page allocated (ENOSPC here, never SIGBUS later); `pace` (an
        agent's CPU cap) before each GROW_PIECE: fresh pages cost CPU to clear."""
        if nbytes <= self.size:
            return
        if self.readonly:
            raise StoreError(f"{self.path} is open read-only and holds {self.size} bytes, not {nbytes}")
        size = _round_up(nbytes)
        try:
            step = GROW_PIECE if pace else size
            for off in range(0, size, step):  # from 0: allocated ranges cost nothing, holes get pages
                if pace:
                    pace()
                os.posix_fallocate(self._fd, off, min(step, size - off))
        except OSError as exc:
            os.ftruncate(self._fd, self.size)  # give back what a failed allocation took
            code = errno.errorcode.get(exc.errno, str(exc.errno))
            kind = StoreFullError if exc.errno in _NO_SPACE else StoreError
            raise kind(f"cannot allocate {size} bytes for {self.path}: {exc.strerror} ({code}); "
                       "free space on the store root or point HPCFT_STORE_ROOT elsewhere") from exc
        self._unmap()
        self._map(size, populate=True)

    def prefault(self) -> None:
        """Map every page of a lazily opened slot before a snapshot is written into it: the copy takes no faults."""
        if self.populated or not self.size or self.readonly:
            return
        size = self.size
        self._unmap()
        self._map(size, populate=True)

    def _map(self, size: int, populate: bool, adopted: mmap.mmap | None = None) -> None:
        # MAP_POPULATE maps every page in this one call, on this thread: right for a writer, which will write
        # them all; a reader does better without (read faults map 16 pages at once, on the threads reading)
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        prot = mmap.PROT_READ | (0 if self.readonly else mmap.PROT_WRITE)
        self._mm = adopted or mmap.mmap(self._fd, size, flags=flags, prot=prot)
        self.array = np.frombuffer(self._mm, dtype=np.uint8)
        self.populated = populate
        self.generation += 1

    def _unmap(self) -> None:
        self.array = np.empty(0, dtype=np.uint8)
        if self._mm is not None:
            with suppress(BufferError):  # a view is still alive somewhere; the mapping goes when it does
                self._mm.close()
            self._mm = None

    def close(self) -> None:
        """Unmap and close; the file (and the snapshot in it) stays."""
        self._unmap()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
