"""One writer per rank store (and one agent per node's protection records): its process holds `writer.lock` (flock,
released when it dies) and names itself there; another process waits up to HANDOVER_S for it, then is refused, naming
it. The wait is the relaunch's: its predecessor on the node, killed with its step, may not have exited yet (hpcft stops
a lost node's steps without waiting for srun to say so). One process's stores of a rank share the lock."""
import fcntl
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from hpcft.errors import StoreError
from hpcft.store.paths import LOCK, open_file
from hpcft.store.pin import process_start

HANDOVER_S = 10.0  # how long a claim waits for the lock's holder to exit (a killed process's exit takes its time)
POLL_S = 0.01
_held: dict[Path, list] = {}  # rank directory -> [its lock file, stores of this process using it]
_claims: dict[Path, threading.Lock] = {}  # rank directory -> one claim of it at a time in this process
_guard = threading.Lock()  # both dicts; never held across a wait


def writer_id() -> str:
    """This process as a writer: `host:pid:start` (the start time makes a reused pid another writer)."""
    pid = os.getpid()
    return f"{socket.gethostname()}:{pid}:{process_start(pid) or 0}"


def claim(rank_dir: Path) -> Callable[[], None]:
    """Claim `rank_dir` for this process (StoreError if another holds it past HANDOVER_S); the release, to call once
    (the process's last release frees it)."""
    with _guard:
        gate = _claims.setdefault(rank_dir, threading.Lock())
    with gate:  # a claim waiting for another process's exit holds up no claim of another directory
        with _guard:
            entry = _held.get(rank_dir)
            if entry is not None:
                entry[1] += 1
        if entry is None:
            entry = [_lock(rank_dir / LOCK), 1]
            with _guard:
                _held[rank_dir] = entry

    def release() -> None:
        with _guard:
            entry[1] -= 1
            if entry[1] == 0 and _held.get(rank_dir) is entry:
                del _held[rank_dir]
                entry[0].close()

    return release


def _lock(path: Path) -> BinaryIO:
    fd = open_file(path, os.O_RDWR, create=True)
    deadline = time.monotonic() + HANDOVER_S
    while not _flocked(fd):
        if time.monotonic() >= deadline:
            other = os.pread(fd, 256, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise StoreError(
                f"store {path.parent} is already being written by {other} (host:pid:start), still after "
                f"{HANDOVER_S:g} s; two runs with the same job id would overwrite each other's snapshots: give this "
                "run its own job id (job_id= or HPCFT_JOB_ID) or stop the other one")
        time.sleep(POLL_S)
    try:  # who holds it, for the message above; best effort (a full store may refuse the page)
        os.ftruncate(fd, 0)
        os.pwrite(fd, writer_id().encode(), 0)
    except OSError:
        pass
    return os.fdopen(fd, "r+b", buffering=0)


def _flocked(fd: int) -> bool:
    """Whether this process now holds `fd`'s exclusive flock (False: another process holds it, or it cannot be had)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False


def unheld(rank_dir: Path) -> bool:
    """Whether no process writes `rank_dir` now: its lock is free (its writer exited) or absent."""
    try:
        fd = os.open(rank_dir / LOCK, os.O_RDWR)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        return _flocked(fd)  # released with the close
    finally:
        os.close(fd)
