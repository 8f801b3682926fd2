"""A relaunched rank's newest snapshot, mapped ahead. A fresh mapping of a slot takes a page fault per 16 pages as the
restore first reads it: 10-15 ms of a 240 MB restore on the 2-core sandbox, seconds for the tens of GB a Frontier
rank holds. `hpcft.init` starts `ahead()` before the process group's rendezvous, so those faults are taken while the
rank waits for its peers. The Slot that opens the same file adopts the mapping (`adopt`: same device, inode and size);
whatever no Slot adopted is dropped after the restore (`release`). Nothing here creates, writes or judges a file:
which version is loaded, and whether its bytes are good, stays the restore's (manifests and checksums)."""
from __future__ import annotations

import ctypes
import mmap
import os
import re
import threading
import time
from pathlib import Path

import numpy as np

from hpcft.errors import HpcftError, StoreError
from hpcft.store.paths import job_dir, open_file, rank_dir, resolve_root

MADV_POPULATE_READ = 22  # Linux 5.14+: map every page of a range in one call; EINVAL before
_MANIFEST = re.compile(r"slot-(\d{1,6})\.json$")
_lock = threading.Lock()
_pending: dict[str, "_Ahead"] = {}


class _Ahead:
    """One slot being (or already) mapped and populated by the prefetch thread."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.done = threading.Event()
        self.mm: mmap.mmap | None = None
        self.key: tuple[int, int, int] | None = None  # st_dev, st_ino, size of the file mapped
        self.seconds = 0.0
        self.dropped = False  # released before it was done: the thread closes the mapping itself


def newest_slot(directory: Path) -> Path | None:
    """The data file of the slot whose manifest was written last (by mtime: nothing is parsed here, the restore
    checks the manifests), or None where there is none."""
    best: tuple[int, str] | None = None
    with os.scandir(directory) as found:
        for e in found:
            m = _MANIFEST.match(e.name)
            if m and e.is_file(follow_symlinks=False):
                t = e.stat(follow_symlinks=False).st_mtime_ns
                if best is None or t > best[0]:
                    best = (t, m.group(1))
    return directory / f"slot-{best[1]}.data" if best else None


def ahead(job_id: str, rank: int, root: str | os.PathLike | None = None) -> threading.Thread | None:
    """Map and populate rank `rank`'s newest slot of job `job_id` in a daemon thread; None where the rank holds none
    (a fresh run) or it is already under way."""
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
    thread = threading.Thread(target=_populate, args=(entry,), name="hpcft-prefetch", daemon=True)
    thread.start()
    return thread


def _madvise_populate(mm: mmap.mmap, size: int) -> bool:
    """Populate the mapping through libc (ctypes drops the GIL for the call; Python's mmap methods hold it)."""
    view = np.frombuffer(mm, dtype=np.uint8)
    address = view.ctypes.data
    del view  # no export left: the mapping can be closed
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(address, size, MADV_POPULATE_READ) == 0


def _populate(entry: _Ahead) -> None:
    t0 = time.perf_counter()
    mm = None
    try:
        fd = open_file(entry.path, os.O_RDWR)
        try:
            st = os.fstat(fd)
            if st.st_size:
                mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                if _madvise_populate(mm, st.st_size):
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
    """The prefetched read-write mapping of `path` if it maps the file open as `fd`, `size` bytes long (waited for if
    still being populated: the faults this caller would take anyway), else None."""
    with _lock:
        entry = _pending.pop(str(path), None)
    if entry is None:
        return None
    entry.done.wait()
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
    try:
        mm.close()
    except BufferError:
        pass  # a view of it is still alive somewhere: the mapping goes when that does
