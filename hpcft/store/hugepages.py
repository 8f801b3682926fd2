"""Whether the store's memory comes in huge pages (a tmpfs's `huge=` option), which decides what a relaunched rank's
first restore costs: mapping a snapshot takes a page-table entry per 4 KiB page (0.4 µs each here: 23 ms for 247 MB,
as long as the copy) or per 2 MiB (0.2 ms). hpcft cannot choose the page size of a tmpfs it did not mount: it says
what it found and what the site could set. `huge=within_size` or `always` give the fallocated slots huge pages;
`advise` does not (fallocate has no mapping to advise)."""
from __future__ import annotations

import os
from pathlib import Path

MODES = ("always", "within_size", "advise", "never", "deny", "force")
HUGE = ("always", "within_size", "force")  # a file written in full gets huge pages without asking
SYSFS = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
MOUNTINFO = Path("/proc/self/mountinfo")
FIX = ("mount the store's tmpfs with huge=within_size (`mount -o remount,huge=within_size /dev/shm`, as root: "
       "slurm/prolog.sh does it per job with HPCFT_SHM_HUGE=within_size) or point HPCFT_STORE_ROOT at such a tmpfs")


def mount_of(path: str | os.PathLike, mountinfo: str) -> tuple[str, str, str]:
    """(mount point, file system type, super options) of the mount holding `path` in a /proc/self/mountinfo text (the
    longest mount point above it, the last of several stacked)."""
    target = os.path.realpath(path)
    best = ("", "", "")
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        point = fields[4].replace("\\040", " ")
        fstype, _source, *opts = line.split(" - ", 1)[1].split()
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[0]):
            best = (point, fstype, opts[0] if opts else "")
    return best


def tmpfs_mode(options: str, sysfs: str = "never") -> str:
    """The huge-page mode of a tmpfs with super `options` under the system-wide `sysfs` setting, whose `force` and
    `deny` override every mount."""
    for forced in ("force", "deny"):
        if f"[{forced}]" in sysfs or sysfs == forced:
            return forced
    for opt in options.split(","):
        key, _, value = opt.partition("=")
        if key == "huge" and value in MODES:
            return value
    return "never"


def _sysfs() -> str:
    try:
        return SYSFS.read_text().strip()
    except OSError:
        return "never"


def mode(path: str | os.PathLike) -> str:
    """`path`'s page mode: a tmpfs's huge-page mode (MODES), or "not tmpfs" (a disk or another file system)."""
    try:
        text = MOUNTINFO.read_text()
    except OSError:
        return "unknown"
    _point, fstype, options = mount_of(path, text)
    return tmpfs_mode(options, _sysfs()) if fstype == "tmpfs" else "not tmpfs"


def describe(path: str | os.PathLike) -> tuple[bool, str]:
    """(the store's memory comes in huge pages, a sentence saying so for `hpcft doctor` and the benches)."""
    m = mode(path)
    if m in HUGE:
        return True, f"{path}: huge pages (tmpfs huge={m}): a relaunched rank maps a snapshot 2 MiB at a time"
    return False, (f"{path}: 4 KiB pages ({'tmpfs huge=' + m if m != 'not tmpfs' else m}): a relaunched rank's first "
                   "restore maps the snapshot 4 KiB at a time (on the sandbox's VMs that costs as much as the copy); "
                   f"{FIX}")
