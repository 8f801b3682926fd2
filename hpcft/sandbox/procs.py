"""Detached daemons we start ourselves, each in its own mount namespace, found and killed by that namespace.

A daemon "group" is one started process and everything it forks (slurmstepds, job tasks), all in the mount namespace
`unshare -m` made for it: killing a group needs no process name. Namespace inodes are reused, so a group is also
marked by a tiny tmpfs whose source name is unique to it; a member's namespace must show that mount."""
import contextlib
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from hpcft.errors import SandboxError

# Start argv in the background with its output appended to $LOG, print its pid, exit: the daemon is
# orphaned at once (no zombie for us to reap) and keeps that pid through nsenter/unshare/sh exec chains.
_SPAWN = 'exec 0</dev/null; "$@" >>"$HPCFT_LOG" 2>&1 & echo $!'


@dataclass(frozen=True)
class Group:
    """A started daemon: pid, its start time (guards against pid reuse), mount namespace inode and marker."""

    pid: int
    start_time: int
    mntns: int
    marker: str

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Group":
        return cls(int(data["pid"]), int(data["start_time"]), int(data["mntns"]), str(data["marker"]))


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()  # fields from 3 (state) on


def _start_time(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None


def alive(pid: int, start_time: int | None = None) -> bool:
    """True if `pid` runs (zombies count as dead) and, when given, started at `start_time`."""
    fields = _stat_fields(pid)
    if not fields or fields[0] in ("Z", "X"):
        return False
    return start_time is None or int(fields[19]) == start_time


def mntns_of(pid: int) -> int | None:
    """The inode of `pid`'s mount namespace, or None if it is gone."""
    try:
        return os.stat(f"/proc/{pid}/ns/mnt").st_ino
    except OSError:
        return None


def shm(pid: int) -> Path:
    """The /dev/shm that process `pid` sees: its sandbox node's, from the host."""
    return Path(f"/proc/{pid}/root/dev/shm")


def has_marker(pid: int, marker: str) -> bool:
    """True if `pid`'s mount namespace holds the tmpfs whose source is `marker`."""
    try:
        text = Path(f"/proc/{pid}/mountinfo").read_text()
    except OSError:
        return False
    return f" - tmpfs {marker} " in text


def pids_in_mntns(inode: int, marker: str) -> list[int]:
    """Every live process whose mount namespace is `inode` and carries `marker`."""
    found = [int(e) for e in os.listdir("/proc") if e.isdigit() and mntns_of(int(e)) == inode and alive(int(e))]
    return found if found and has_marker(found[0], marker) else []


def namespaced(argv: Sequence[str], *, marker: str, marker_dir: Path, netns: str | None = None,
               hostname: str | None = None, binds: Sequence[tuple[Path, str]] = (),
               tmpfs: Sequence[tuple[str, str, str]] = (), cgroups: Sequence[Path] = (),
               cgroup_mounts: Sequence[tuple[str, str]] = ()) -> list[str]:
    """argv run in a new private mount namespace (and UTS namespace with `hostname`, net namespace `netns`): the
    marker tmpfs on `marker_dir`, bind mounts (source, target), tmpfs mounts (name, options, target), then `exec
    argv`. With `cgroups` it first joins those (v1) cgroups and makes a cgroup namespace rooted there, in which each
    (controller, mount point) of `cgroup_mounts` is mounted afresh: its own view. Not `ip netns exec`: it remounts
    /sys."""
    q = shlex.quote
    steps = ["set -e"]
    if hostname:
        steps.append(f"hostname {q(hostname)}")
    steps.append(f"mount -t tmpfs -o size=4k,mode=0700 {q(marker)} {q(str(marker_dir))}")
    steps += [f"mount --bind {q(str(src))} {q(dst)}" for src, dst in binds]
    steps += [f"mount -t tmpfs -o {q(opts)} {q(name)} {q(target)}" for name, opts, target in tmpfs]
    for controller, point in cgroup_mounts:  # unmounted first: the kernel refuses the same hierarchy on its own root
        steps += [f"umount {q(point)}", f"mount -t cgroup -o {q(controller)} cgroup {q(point)}"]
    steps.append("exec " + " ".join(q(str(a)) for a in argv))
    cmd = ["unshare", "-m", *(["--uts"] if hostname else []), *(["--cgroup"] if cgroups else []),
           "--propagation", "private", "sh", "-c", "\n".join(steps)]
    if cgroups:  # joined before the namespace is made: its root is where the shell is then
        joins = "".join(f"echo $$ > {q(str(Path(c) / 'cgroup.procs'))}\n" for c in cgroups)
        cmd = ["sh", "-c", f"set -e\n{joins}exec " + " ".join(q(a) for a in cmd)]
    return (["nsenter", f"--net=/run/netns/{netns}"] if netns else []) + cmd


def tail(path: Path, lines: int = 15) -> str:
    """The last lines of a log file, for error messages."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no log at {path})"
    return "\n".join(text.rstrip().splitlines()[-lines:])


def spawn(argv: Sequence[str], log: Path, marker: str, timeout: float = 5.0) -> Group:
    """Start a `namespaced` argv detached from us; return once its namespace shows `marker`."""
    env = dict(os.environ, HPCFT_LOG=str(log))
    proc = subprocess.run(["sh", "-c", _SPAWN, "sh", *argv], capture_output=True, text=True, env=env,
                          start_new_session=True)
    if proc.returncode != 0 or not proc.stdout.strip().isdigit():
        raise SandboxError(f"could not start {argv[0]}: {proc.stderr.strip() or proc.stdout.strip()}")
    pid = int(proc.stdout.strip())
    deadline = time.monotonic() + timeout
    while True:
        start, ns = _start_time(pid), mntns_of(pid)
        if start is None or not alive(pid):
            raise SandboxError(f"{marker} exited while starting; its log {log}:\n{tail(log)}")
        if ns is not None and has_marker(pid, marker):
            return Group(pid, start, ns, marker)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            raise SandboxError(f"pid {pid} did not set up its namespace within {timeout:g} s; log {log}:\n{tail(log)}")
        time.sleep(0.005)


def members(group: Group) -> list[int]:
    """The live processes of a group: the daemon (if it is still ours) and all in its mount namespace."""
    pids = set(pids_in_mntns(group.mntns, group.marker))
    if alive(group.pid, group.start_time):
        pids.add(group.pid)
    return sorted(pids)


def signal_members(group: Group, sig: int) -> list[int]:
    """Send `sig` once to every member (SIGSTOP, SIGCONT: they stay members); a second pass catches one forked
    during the first. The pids signalled."""
    sent: set[int] = set()
    for _ in range(2):
        for pid in set(members(group)) - sent:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
                sent.add(pid)
    return sorted(sent)


def stopped(pid: int) -> bool:
    """True if `pid` is stopped (SIGSTOP): alive, but answering nothing."""
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] in ("T", "t")


def _leaves_first(pids: list[int]) -> list[int]:
    """`pids` with every process before its parent. A frozen node killed parents first would run again: a stopped
    process group orphaned by its parent's death gets SIGHUP and SIGCONT from the kernel (POSIX), and an srun woken
    so forwards SIGKILL to its step's tasks on every other node, which no crashed node can do."""
    parent = {}
    for pid in pids:
        fields = _stat_fields(pid)
        parent[pid] = int(fields[1]) if fields else 0

    def depth(pid: int) -> int:
        d, seen = 0, {pid}
        while (pid := parent.get(pid, 0)) in parent and pid not in seen:
            d, seen = d + 1, seen | {pid}
        return d

    return sorted(pids, key=depth, reverse=True)


def kill(group: Group, sig: int = signal.SIGKILL, timeout: float = 5.0) -> None:
    """Send `sig` to every member until none is left (SIGKILL: children before parents) or the daemon itself has
    exited (others)."""
    deadline = time.monotonic() + timeout
    while True:
        pids = (_leaves_first(members(group)) if sig == signal.SIGKILL
                else [p for p in [group.pid] if alive(p, group.start_time)])
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        if time.monotonic() > deadline:
            raise SandboxError(f"processes {pids} did not exit within {timeout:g} s after signal {sig}")
        time.sleep(0.02)
