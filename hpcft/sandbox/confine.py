"""The confined sandbox (`hpcft sandbox up --confine`): Slurm's task/cgroup, task/affinity and proctrack/cgroup on
cgroup v1, with 8 fake GPUs per node as GRES. Every slurmd runs on this one host, so each gets its own sub-cgroup of
ours in each controller Slurm uses, joined before a new cgroup namespace: Slurm's `slurm/uid_0/job_N/step_M` paths
are then a node's own, and /proc/<pid>/cgroup inside reads as on a real node. The fake GPUs are character devices of
a major no driver holds: the devices cgroup decides at open(), so a step's own device fails with ENXIO, another
step's with EPERM."""
import errno
import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

from hpcft.errors import SandboxError
from hpcft.launch.node import cgroups
from hpcft.sandbox.config import GPUS

CONTROLLERS = ("cpuset", "memory", "devices", "freezer")  # what Slurm's cgroup/v1 plugin uses with this cgroup.conf
PLUGINS = Path("/usr/lib/x86_64-linux-gnu/slurm-wlm")
_NEEDED_PLUGINS = ("cgroup_v1.so", "task_cgroup.so", "task_affinity.so", "proctrack_cgroup.so", "gres_gpu.so")
_FREE_MAJORS = range(260, 384)  # character majors no driver is given by the kernel's dynamic allocation


def _mountinfo() -> str:
    return Path("/proc/self/mountinfo").read_text()


def our_cgroup(controller: str) -> Path | None:
    """Where this process's cgroup of v1 `controller` is (None where that hierarchy is not mounted as v1)."""
    path = cgroups.own().get(controller)
    return cgroups.directory(controller, path, _mountinfo()) if path is not None else None


def mount_point(controller: str) -> str:
    """Where v1 `controller` is mounted on this host: a node mounts its own view there."""
    for _, point, opts in cgroups.mounts(_mountinfo()):
        if controller in opts and "" not in opts:
            return point
    raise SandboxError(f"cgroup v1 controller {controller} is not mounted")


def unavailable_reason() -> str | None:
    """Why this machine cannot run a confined sandbox (no cgroup v1 controllers, no cgroup namespaces, Slurm's
    plugins missing), or None."""
    missing = [c for c in CONTROLLERS if our_cgroup(c) is None]
    if missing:
        return f"cgroup v1 controllers {', '.join(missing)} are not mounted (the confined sandbox uses cgroup/v1)"
    gone = [p for p in _NEEDED_PLUGINS if not (PLUGINS / p).exists()]
    if gone:
        return f"Slurm plugins {', '.join(gone)} are missing from {PLUGINS}"
    probe = subprocess.run(["unshare", "--cgroup", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create a cgroup namespace (`unshare --cgroup`: {probe.stderr.strip()})"
    return None


def node_cgroups(tag: str, node: str) -> list[Path]:
    """Node `node`'s cgroup in each controller: `<our cgroup>/hpcft-sandbox-<tag>/<node>`."""
    found = []
    for controller in CONTROLLERS:
        base = our_cgroup(controller)
        if base is None:
            raise SandboxError(f"cgroup v1 controller {controller} is not mounted: the confined sandbox needs it")
        found.append(base / f"hpcft-sandbox-{tag}" / node)
    return found


def create(directories: list[Path]) -> None:
    """Make the cgroups (and their parents); a new cpuset gets its parent's CPUs and memory nodes, as it must before
    a task may join it."""
    for leaf in directories:
        for path in reversed([leaf, *leaf.parents][:2]):  # the sandbox's cgroup, then the node's
            path.mkdir(exist_ok=True)
            for name in ("cpuset.cpus", "cpuset.mems"):
                own = path / name
                if own.exists() and not own.read_text().strip():
                    own.write_text((path.parent / name).read_text())


def clear(directory: Path, *, keep: bool = True, timeout: float = 10.0) -> None:
    """Remove the cgroups below `directory` (and it too, unless `keep`), deepest first; those whose tasks are still
    exiting (EBUSY) are tried again until `timeout`."""
    deadline = time.monotonic() + timeout
    while directory.is_dir():
        below = sorted((p for p in directory.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True)
        busy = []
        for path in [*below, *([] if keep else [directory])]:
            try:
                path.rmdir()
            except FileNotFoundError:
                pass
            except OSError as exc:
                if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise SandboxError(f"cannot remove cgroup {path}: {exc.strerror}") from exc
                busy.append(path)
        if not busy:
            return
        time.sleep(0.05)


def remove(directories: list[Path]) -> None:
    """Remove each node cgroup, what Slurm made below it, and the sandbox's cgroup above it once empty."""
    for leaf in directories:
        clear(leaf, keep=False)
        try:
            leaf.parent.rmdir()
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno not in (errno.EBUSY, errno.ENOTEMPTY):  # another node's is still there: removed with it
                raise SandboxError(f"cannot remove cgroup {leaf.parent}: {exc.strerror}") from exc


def mounts_inside() -> list[tuple[str, str]]:
    """(controller, mount point) for `procs.namespaced`: each mounted afresh in the node's cgroup namespace."""
    return [(c, mount_point(c)) for c in CONTROLLERS]


def _free_major() -> int:
    """A character major no driver holds now (listed in /proc/devices)."""
    taken, chars = set(), False
    for line in Path("/proc/devices").read_text().splitlines():
        if line.strip().endswith("devices:"):
            chars = line.startswith("Character")
        elif chars and line.split() and line.split()[0].isdigit():
            taken.add(int(line.split()[0]))
    return next(m for m in _FREE_MAJORS if m not in taken)


def make_gpus(dev_dir: Path) -> list[Path]:
    """The fake GPUs gpu0..gpu7 in `dev_dir`: character devices of one free major, minors 0..7."""
    shutil.rmtree(dev_dir, ignore_errors=True)
    dev_dir.mkdir(parents=True, mode=0o755)
    major = _free_major()
    made = []
    for minor in range(GPUS):
        path = dev_dir / f"gpu{minor}"
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
        os.chmod(path, 0o666)
        made.append(path)
    return made


def render_cgroup_conf() -> str:
    """cgroup.conf: cores, memory and devices constrained, on the cgroup v1 plugin."""
    return ("# Written by `hpcft sandbox up --confine`.\nCgroupPlugin=cgroup/v1\nConstrainCores=yes\n"
            "ConstrainRAMSpace=yes\nConstrainDevices=yes\n")


def render_gres_conf(dev_dir: Path) -> str:
    """gres.conf: every node's 8 GPUs are the fake devices (one set of files; each step's devices cgroup tells
    them apart)."""
    return f"# Written by `hpcft sandbox up --confine`.\nName=gpu File={dev_dir}/gpu[0-{GPUS - 1}]\n"


def prepare_node(tag: str, node: str) -> tuple[list[Path], dict]:
    """Before node `node`'s slurmd starts (again): its cgroups, emptied of what an earlier slurmd of it left (a
    crash leaves Slurm's job cgroups), and the `procs.namespaced` options that put the slurmd in them."""
    directories = node_cgroups(tag, node)
    create(directories)
    for directory in directories:
        clear(directory)
    return directories, {"cgroups": directories, "cgroup_mounts": mounts_inside()}


def write_files(etc_cgroup: Path, etc_gres: Path, dev_dir: Path, confined: bool) -> None:
    """cgroup.conf, gres.conf and the fake GPUs for a confined sandbox; none of them (an earlier one's) otherwise."""
    if confined:
        make_gpus(dev_dir)
        etc_cgroup.write_text(render_cgroup_conf())
        etc_gres.write_text(render_gres_conf(dev_dir))
        return
    etc_cgroup.unlink(missing_ok=True)
    etc_gres.unlink(missing_ok=True)
    shutil.rmtree(dev_dir, ignore_errors=True)
