"""A relaunched rank's newest snapshot, mapped ahead: a fresh mapping takes a page fault per 16 pages as the restore
first reads it (10-15 ms of a 600 MB restore here, seconds for a Frontier rank's tens of GB), so `ahead()` maps them
while the rank waits for its peers. The Slot that opens the same file adopts the mapping (`adopt`: same device, inode
and size), helping to populate the rest; what no Slot adopted is dropped (`release`). Nothing here creates, writes or
judges a file: which version is loaded, and whether its bytes are good, stays the restore's."""
from __future__ import annotations

import ctypes
import functools
import mmap
import os
import stat
import threading
import time
from contextlib import suppress
from pathlib import Path

import numpy as np

from hpcft.env import usable_cores
from hpcft.errors import HpcftError, StoreError
from hpcft.store import ntcopy
from hpcft.store.paths import DATA, job_dir, open_file, rank_dir, resolve_root, slot_file, slot_files

MADV_POPULATE_READ = 22  # Linux 5.14+: map every page of a range in one call; EINVAL before
_lock = threading.Lock()
_pending: dict[str, "_Ahead"] = {}


class Pieces:
    """A mapped range to populate in `PIECE`-sized pieces, each taken by whichever thread calling `work` is free: in
    one C call per thread (no GIL between pieces, ntcopy.populate_loop), else piece by piece from Python."""

    def __init__(self, address: int, size: int) -> None:
        self.address, self.size = address, size
        self.count = -(-size // PIECE)
        self._state = np.zeros(3, dtype=np.uint64)  # next piece, pieces done, pieces refused (the C loop's counters)
        self._lock = threading.Lock()  # the Python loop's, for the same counters
        self.populated = threading.Event()  # every piece is populated; `failed` says whether the kernel refused any
        if not self.count:
            self.populated.set()

    @property
    def failed(self) -> bool:
        return bool(self._state[2])

    def work(self) -> None:
        """Populate pieces until none is left; a thread that finds them all done sets `populated`."""
        loop = ntcopy.populate_loop()
        if loop is not None:
            at = self._state.ctypes.data
            loop(self.address, self.size, PIECE, at, at + 8, at + 16)
        else:
            while True:
                with self._lock:
                    i = int(self._state[0])
                    self._state[0] += 1
                if i >= self.count:
                    break
                ok = _madvise(self.address + i * PIECE, min(PIECE, self.size - i * PIECE))
                with self._lock:
                    self._state[1] += 1
                    self._state[2] += not ok
        if int(self._state[1]) >= self.count:
            self.populated.set()


class _Ahead:
    """One slot being (or already) mapped and populated by the prefetch thread; a Slot adopting it before it is done
    populates the rest alongside (`help`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.done = threading.Event()  # the prefetch thread is finished: `mm` is the mapping, or None
        self.mm: mmap.mmap | None = None
        self.key: tuple[int, int, int] | None = None  # st_dev, st_ino, size of the file mapped
        self.seconds = 0.0
        self.dropped = False  # released before it was done: the thread closes the mapping itself
        self.pieces: Pieces | None = None  # set once the file is mapped

    def help(self) -> None:
        """Populate alongside the prefetch thread (where it has mapped the file already), then wait for it."""
        pieces = self.pieces
        if pieces is not None:
            pieces.work()
        self.done.wait()


def newest_slot(directory: Path) -> Path | None:
    """The data file of the slot whose manifest was written last (by mtime: nothing is parsed here), or None."""
    found = [(st.st_mtime_ns, k) for k, path in slot_files(directory).items()
             if stat.S_ISREG((st := path.lstat()).st_mode)]
    return slot_file(directory, max(found)[1], DATA) if found else None


MAX_THREADS = 4  # populating threads of one rank at most: the kernel's page-table work stops scaling past a few


def threads(busy: int = 0) -> int:
    """Threads to populate with: the cores this process may run on (a Frontier rank has 7) less `busy` ones kept for
    the caller, at least 1 and at most MAX_THREADS."""
    return max(1, min(MAX_THREADS, usable_cores() - busy))


def ahead(job_id: str, rank: int, root: str | os.PathLike | None = None, threads: int = 1) -> threading.Thread | None:
    """Map and populate rank `rank`'s newest slot of job `job_id` in a daemon thread (with `threads` - 1 helpers);
    None where the rank holds none (a fresh run) or it is already under way."""
    try:
        path = newest_slot(rank_dir(job_dir(resolve_root(root), job_id), rank))
    except (OSError, KeyError, HpcftError):  # no store here (a fresh run), no user name: nothing to map ahead
        return None
    if path is None:
        return None
    entry = _Ahead(path)
    with _lock:
        if str(path) in _pending:
            return None
        _pending[str(path)] = entry
    thread = threading.Thread(target=_populate, args=(entry, max(1, threads)), name="hpcft-prefetch", daemon=True)
    thread.start()
    return thread


PIECE = 16 << 20  # populated per call: small enough for an adopter to share the rest, large enough to stay cheap


def _madvise(address: int, size: int) -> bool:
    """Map every page of the `size` bytes at `address` in one call, at less than half the cost of read faults (0.08
    against 0.2 us a 4 KiB page), without the GIL (which Python's mmap methods hold). False before Linux 5.14."""
    return _libc().madvise(address, size, MADV_POPULATE_READ) == 0


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _populate(entry: _Ahead, threads: int) -> None:
    t0 = time.perf_counter()
    mm = None
    try:
        fd = open_file(entry.path, os.O_RDWR)
        try:
            st = os.fstat(fd)
            if st.st_size:
                mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                view = np.frombuffer(mm, dtype=np.uint8)
                address = view.ctypes.data
                del view  # no export left: the mapping can be closed
                if _madvise(address, min(st.st_size, mmap.PAGESIZE)):
                    pieces = entry.pieces = Pieces(address, st.st_size)
                    helpers = [threading.Thread(target=pieces.work, name="hpcft-prefetch", daemon=True)
                               for _ in range(threads - 1)]
                    for t in helpers:
                        t.start()
                    pieces.work()
                    pieces.populated.wait()  # pieces a helper or an adopter still populates
                    if not pieces.failed:
                        entry.key = (st.st_dev, st.st_ino, st.st_size)
                else:  # an older kernel: faulting it from here would hold the GIL; the restore faults it instead
                    mm.close()
                    mm = None
        finally:
            os.close(fd)
    except (StoreError, OSError):
        mm = None  # the restore opens the file itself and reports what is wrong with it
    with _lock:
        entry.seconds = time.perf_counter() - t0
        if entry.dropped and mm is not None:
            _close(mm)
            mm = None
        entry.mm = mm
        entry.done.set()


def adopt(path: Path, fd: int, size: int) -> mmap.mmap | None:
    """The prefetched read-write mapping of `path` if it maps the file open as `fd`, `size` bytes long, else None; one
    still being populated is finished with this thread's help."""
    with _lock:
        entry = _pending.pop(str(path), None)
    if entry is None:
        return None
    entry.help()
    if entry.mm is None:
        return None
    st = os.fstat(fd)
    if entry.key != (st.st_dev, st.st_ino, size):  # replaced or resized since: map it afresh
        _close(entry.mm)
        return None
    return entry.mm


def seconds(path: Path) -> float | None:
    """How long the prefetch of `path` took, once done (the benches' figure); None if none is pending for it."""
    with _lock:
        entry = _pending.get(str(path))
    if entry is None or not entry.done.is_set():
        return None
    return entry.seconds


def release() -> None:
    """Drop every prefetched mapping no Slot adopted (the restore loaded another slot, or nothing)."""
    with _lock:
        rest = list(_pending.values())
        _pending.clear()
        for entry in rest:
            entry.dropped = True
            if entry.mm is not None:
                _close(entry.mm)
                entry.mm = None


def _close(mm: mmap.mmap) -> None:
    with suppress(BufferError):  # a view of it is still alive somewhere: the mapping goes when that does
        mm.close()
