"""Which cgroups a process is in, where they are mounted, and moving this process into another's: how a warm-started
rank joins its trainer step's cgroups (its cores, memory and devices, as Slurm's task/cgroup confined the step)
before it touches a device. cgroup v1 hierarchies and v2 alike; parsing is pure."""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


class CgroupError(OSError):
    """A cgroup this process must join cannot be reached or written (the message says which, and why)."""


def membership(text: str) -> dict[str, str]:
    """{hierarchy: path} from /proc/<pid>/cgroup: a v1 hierarchy by its controllers as the kernel names it ("cpuset",
    "cpu,cpuacct", "name=systemd"), v2 as ""."""
    found = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            found[parts[1]] = parts[2]
    return found


def _unescape(field: str) -> str:
    """A mountinfo path field with its octal escapes (\\040 for a space) decoded."""
    return field.encode().decode("unicode_escape") if "\\" in field else field


def mounts(mountinfo: str) -> list[tuple[str, str, frozenset[str]]]:
    """(mount root, mount point, super options) of every cgroup mount in /proc/<pid>/mountinfo text; v2 as options
    {""}, so that hierarchy "" matches it."""
    found = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        fstype, options = fields[sep + 1], fields[sep + 3] if len(fields) > sep + 3 else ""
        if fstype in ("cgroup", "cgroup2"):
            opts = frozenset([""]) if fstype == "cgroup2" else frozenset(options.split(","))
            found.append((_unescape(fields[3]), _unescape(fields[4]), opts))
    return found


def directory(hierarchy: str, path: str, mountinfo: str) -> Path | None:
    """Where cgroup `path` of `hierarchy` is in this mount namespace: under a mount of that hierarchy whose root
    contains it (a bind mount of a sub-cgroup reaches only what is below it); None where none does."""
    wanted = set(hierarchy.split(","))
    for root, point, opts in mounts(mountinfo):
        if not wanted <= opts:
            continue
        rel = os.path.relpath(path, root)
        if rel == "." or not rel.startswith(".."):
            return Path(point) if rel == "." else Path(point) / rel
    return None


def own(pid: int | str = "self") -> dict[str, str]:
    """This process's (or `pid`'s) cgroups: {hierarchy: path}."""
    return membership(Path(f"/proc/{pid}/cgroup").read_text())


# What a warm child needs to join its step's cgroups: root, or write access to each target cgroup.procs (v1: the
# file, owned by whoever made the cgroup; v2 also the common ancestor's). docs/design.md says what Slurm grants.
_NEEDS = ("a process of the user joins another step's cgroups only where it may write their cgroup.procs "
          "(Slurm's cgroup/v1 makes them root's, mode 0644: as another user the rank starts cold)")


def join(target: Mapping[str, str]) -> list[str]:
    """Move this process into the cgroups `target` names ({hierarchy: path}, another process's `own()`), in every
    hierarchy where it is elsewhere; the hierarchies it moved in. CgroupError (nothing is undone) where it cannot:
    the caller must then not run as if it had joined."""
    ours, info = own(), Path("/proc/self/mountinfo").read_text()
    moved = []
    for hierarchy, path in target.items():
        if ours.get(hierarchy, path) == path:  # already there, or a hierarchy this kernel/namespace lacks
            continue
        where = directory(hierarchy, path, info)
        if where is None:
            raise CgroupError(f"the {hierarchy or 'v2'} cgroup {path} is not mounted in this namespace")
        procs = where / "cgroup.procs"
        try:
            procs.write_text(f"{os.getpid()}\n")
        except OSError as exc:
            raise CgroupError(exc.errno, f"cannot join {procs}: {exc.strerror}; {_NEEDS}") from exc
        moved.append(hierarchy)
    return moved
