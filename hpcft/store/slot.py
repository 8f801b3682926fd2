"""One reusable data file of the store: allocated once, pre-faulted, mapped shared, grown only if needed."""
import errno
import mmap
import os
from pathlib import Path

import numpy as np

from hpcft.errors import StoreError
from hpcft.store.paths import check_file

GRAIN = 1 << 20  # sizes are rounded up to this, so small layout changes do not regrow the file
_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC


def _round_up(n: int, grain: int = GRAIN) -> int:
    return max(grain, -(-n // grain) * grain)


class Slot:
    """A data file `slot-<k>.data` and its shared mapping; `array` is a uint8 view of all of it."""

    def __init__(self, index: int, path: Path, *, readonly: bool = False):
        self.index = index
        self.path = path
        self.readonly = readonly
        self.generation = 0  # bumped whenever the mapping moves (copiers re-register pinned memory)
        self._fd = os.open(path, _FLAGS | (os.O_RDONLY if readonly else os.O_RDWR | os.O_CREAT), 0o600)
        try:
            check_file(self._fd, path)
        except StoreError:
            os.close(self._fd)
            raise
        self._mm: mmap.mmap | None = None
        self.array = np.empty(0, dtype=np.uint8)
        size = os.fstat(self._fd).st_size
        if size:
            self._map(size)

    @property
    def size(self) -> int:
        return self.array.size

    def ensure(self, nbytes: int) -> None:
        """Make the file at least `nbytes` long with every page allocated (ENOSPC here, never SIGBUS later)."""
        if nbytes <= self.size:
            return
        if self.readonly:
            raise StoreError(f"{self.path} is open read-only and holds {self.size} bytes, not {nbytes}")
        size = _round_up(nbytes)
        try:
            os.posix_fallocate(self._fd, 0, size)
        except OSError as exc:
            os.ftruncate(self._fd, self.size)  # give back what a failed allocation took
            code = errno.errorcode.get(exc.errno, str(exc.errno))
            raise StoreError(f"cannot allocate {size} bytes for {self.path}: {exc.strerror} ({code}); "
                             "free space on the store root or point HPCFT_STORE_ROOT elsewhere") from exc
        self._unmap()
        self._map(size)

    def _map(self, size: int) -> None:
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        prot = mmap.PROT_READ | (0 if self.readonly else mmap.PROT_WRITE)
        self._mm = mmap.mmap(self._fd, size, flags=flags, prot=prot)
        self.array = np.frombuffer(self._mm, dtype=np.uint8)
        self.generation += 1

    def _unmap(self) -> None:
        self.array = np.empty(0, dtype=np.uint8)
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # a view is still alive somewhere; the mapping goes when it does
            self._mm = None

    def close(self) -> None:
        """Unmap and close; the file (and the snapshot in it) stays."""
        self._unmap()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
