"""A small file system that the sandbox's nodes share with this host, as a job directory on a quota'd Lustre is: an
ext4 image on a loop device, mounted at one path here and in every node's mount namespace (the same device, so the
same file system: a write on one is seen on all, and it fills for all at once)."""
import subprocess
from contextlib import contextmanager
from collections.abc import Iterator
from pathlib import Path

import pytest


def _run(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout.strip()


@contextmanager
def shared_fs(sandbox, path: Path, mib: int) -> Iterator[Path]:
    """`path` on a fresh `mib` MiB ext4 file system, seen at the same path by this host and every sandbox node."""
    if not Path("/dev/loop-control").exists():
        pytest.skip("no loop devices on this machine (/dev/loop-control): no file system to fill")
    path.mkdir(parents=True, exist_ok=True)
    image = path.with_name(path.name + ".img")
    _run("truncate", "-s", f"{mib}M", str(image))
    _run("mkfs.ext4", "-q", "-F", "-m", "0", str(image))
    device = _run("losetup", "--find", "--show", str(image))
    mounted: list[list[str]] = []
    try:
        _run("mount", device, str(path))
        mounted.append([])
        for node in sandbox.node_names:
            pid = sandbox.node_pids(node)[0]  # its slurmd: its steps live in its mount namespace
            enter = ["nsenter", f"--mount=/proc/{pid}/ns/mnt"]
            _run(*enter, "mount", device, str(path))
            mounted.append(enter)
        yield path
    finally:
        for enter in reversed(mounted):  # a node crashed and restarted since has a new namespace: nothing to undo
            subprocess.run([*enter, "umount", "-l", str(path)], capture_output=True)
        subprocess.run(["losetup", "-d", device], capture_output=True)
        image.unlink(missing_ok=True)


def fill(path: Path) -> None:
    """Fill the file system of `path` to its last byte (what a full quota looks like to a writer)."""
    with open(path / "filler", "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * (1 << 20))
                fh.flush()
        except OSError:
            pass
    with open(path / "filler-tail", "wb") as fh:  # the last blocks, a few KiB at a time
        try:
            while True:
                fh.write(b"\0" * 4096)
                fh.flush()
        except OSError:
            pass
