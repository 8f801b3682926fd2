"""What one node's memory holds and offers for snapshots: MemAvailable, free bytes of the store's file system, and
the job store's own bytes. Read by the node agents (reported in their status) and by `hpcft run`'s memory plan."""
from __future__ import annotations

import os
import stat
from contextlib import suppress
from pathlib import Path
from typing import Any

from hpcft.store.paths import DATA, ranks, slot_files

UNKNOWN_AVAILABLE = 1 << 46  # what mem_available() says when /proc/meminfo cannot tell


def mem_available(meminfo: str = "/proc/meminfo") -> int:
    """Bytes of memory this node could still give (MemAvailable), or a large bound when it cannot be read."""
    try:
        with open(meminfo, encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return UNKNOWN_AVAILABLE


def fs_free(root: str | os.PathLike) -> int:
    """Bytes an unprivileged writer may still allocate under `root` (/dev/shm: the tmpfs size limit)."""
    st = os.statvfs(root)
    return st.f_bavail * st.f_frsize


def snapshot_bytes(store_job: Path) -> int | None:
    """One snapshot's bytes on this node: each rank's largest slot data file, summed; None before any."""
    sizes = []
    for rank_dir in ranks(store_job).values():
        files = []
        for f in slot_files(rank_dir, DATA).values():
            with suppress(OSError):  # the trainers may free a slot meanwhile: a report never fails for it
                files.append(f.stat().st_size)
        if files:
            sizes.append(max(files))
    return sum(sizes) if sizes else None


def used_bytes(store_job: Path) -> int:
    """Bytes the job's store on this node takes now (allocated blocks of every file under it)."""
    total = 0
    for top, _dirs, files in os.walk(store_job):  # os.walk skips a directory removed meanwhile
        for name in files:
            try:
                st = os.lstat(os.path.join(top, name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_blocks * 512
    return total


def figures(store_job: Path) -> dict[str, Any]:
    """The status fields of a node's memory: snapshot_bytes, store_bytes, shm_free (of the store's file system) and
    mem_available."""
    return {"snapshot_bytes": snapshot_bytes(store_job), "store_bytes": used_bytes(store_job),
            "shm_free": fs_free(store_job), "mem_available": mem_available()}
