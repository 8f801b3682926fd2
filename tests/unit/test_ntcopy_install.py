"""`pip install` builds the copy kernel (a normal build step), and without a compiler still installs, warns and
leaves copies to memcpy: real installs of this source tree into a --target directory (offline, no deps)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

# After the install: which hpcft was imported, whether its kernel loads, and the warnings of two copies.
PROBE = """
import logging, numpy as np
logging.basicConfig(level=logging.WARNING, format="LOG %(levelname)s %(message)s")
import hpcft
from hpcft.store import ntcopy
print("FILE", hpcft.__file__)
print("KERNEL", ntcopy.available(), ntcopy.kernel_path())
a, b = np.arange(1 << 16, dtype=np.uint8), np.zeros(1 << 16, dtype=np.uint8)
ntcopy.copy(b, a); ntcopy.copy(b, a)
assert np.array_equal(a, b)
"""


def _bare_path(tmp_path: Path) -> str:
    """A PATH with python and nothing else: no cc, no gcc."""
    bare = tmp_path / "bin"
    bare.mkdir()
    os.symlink(sys.executable, bare / "python3")
    return str(bare)


def _install(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, Path]:
    """Install a fresh copy of the source tree (as a clone has it: no built library) into tmp_path/site."""
    src, site = tmp_path / "src", tmp_path / "site"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "hpcft", src / "hpcft", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-v", "--no-deps", "--no-build-isolation",
                           "--no-index", "--target", str(site), str(src)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, site


def _probe(site: Path, env: dict[str, str]) -> str:
    proc = subprocess.run([sys.executable, "-c", PROBE], env={**env, "PYTHONPATH": str(site)},
                          capture_output=True, text=True, timeout=60, cwd=site)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"FILE {site}" in proc.stdout  # the installed copy, not this checkout
    return proc.stdout + proc.stderr


def test_install_builds_the_kernel(tmp_path: Path) -> None:
    if not (shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")):
        pytest.skip("no C compiler on this machine")
    _, site = _install(tmp_path, dict(os.environ))
    built = list((site / "hpcft" / "store").glob("_ntcopy*.so"))
    assert len(built) == 1
    out = _probe(site, dict(os.environ))
    assert f"KERNEL True {built[0]}" in out and "LOG WARNING" not in out


def test_install_without_a_compiler_warns_and_falls_back(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": _bare_path(tmp_path), "CC": "/bin/false"}
    proc, site = _install(tmp_path, env)
    assert "could not build its streaming-store copy kernel" in proc.stdout + proc.stderr
    assert not list((site / "hpcft" / "store").glob("_ntcopy*.so"))
    out = _probe(site, env)
    assert "KERNEL False None" in out
    warnings = [line for line in out.splitlines() if line.startswith("LOG WARNING")]
    assert len(warnings) == 1 and "C compiler" in warnings[0], out


RANK = """
import torch
from hpcft import Checkpointer, Options
from hpcft.store import ntcopy
net = torch.nn.Linear(64, 64)
opt = torch.optim.AdamW(net.parameters())
with Checkpointer(net, opt, Options(root=ROOT, job_id="nocc", backend="cpu")) as ckpt:
    for _ in range(3):
        net(torch.randn(4, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
    ckpt.wait()
    assert ckpt.restore() == 3
print("KERNEL", ntcopy.available(), ntcopy.__file__)
"""


def test_a_rank_compiles_nothing(tmp_path: Path, shm_root: Path) -> None:
    """A rank process with no compiler reachable and an empty home snapshots and restores with the kernel
    the install built, and leaves nothing in its home or cache (no run-time build, no per-user cache)."""
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "PATH": _bare_path(tmp_path), "CC": "/bin/false", "HOME": str(home),
           "XDG_CACHE_HOME": str(home / ".cache"), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", RANK.replace("ROOT", repr(str(shm_root)))], env=env,
                          capture_output=True, text=True, timeout=120, cwd=home)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"KERNEL True {REPO}" in proc.stdout
    assert list(home.rglob("*")) == []
