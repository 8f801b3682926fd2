"""Fixtures shared by the unit tests."""
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from hpcft.store import RankStore

if not torch.cuda.is_available():
    # Triton reads this when it is first imported, by whichever test: its interpreter then runs the GPU checksum
    # kernel on CPU tensors (tests/unit/test_devcrc.py); on a GPU the kernel is compiled as in production
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def shm_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A store root on the real /dev/shm (events under tmp_path/events), removed afterwards."""
    monkeypatch.setenv("HPCFT_EVENT_DIR", str(tmp_path / "events"))
    path = Path(tempfile.mkdtemp(prefix="hpcft-test-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def slot():
    """A 1 MiB slot of a store on the real /dev/shm, for the copiers' tests."""
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        store = RankStore("s", 0, root=Path(d))
        yield store.begin(1 << 20)
        store.close()


@pytest.fixture
def mount_tmpfs(tmp_path: Path):
    """`mount_tmpfs(size)` mounts a tmpfs of `size` (mount's syntax: `1600k`) under tmp_path and returns it; skips
    the test where that needs root or is refused; everything mounted is unmounted afterwards."""
    mounted = []

    def mount(size: str) -> Path:
        if os.geteuid() != 0 or not shutil.which("mount"):
            pytest.skip("mounting a tmpfs needs root")
        mnt = tmp_path / f"tmpfs-{len(mounted)}"
        mnt.mkdir()
        rc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mnt)],
                            capture_output=True, text=True)
        if rc.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {rc.stderr.strip()}")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
