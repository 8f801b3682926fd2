"""The device backends (torch streams on CUDA/ROCm, hip-python) on a real GPU; skipped without one."""
from pathlib import Path

import pytest
import torch

from hpcft.checkpointer import Checkpointer
from hpcft.deps import available
from hpcft.options import Options
from hpcft.snapshot.state import collect

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA/ROCm GPU visible to torch")
BACKENDS = ["torch", pytest.param("hip", marks=pytest.mark.skipif(
    not (torch.version.hip and available("hip.hip")), reason="hip backend needs a ROCm build and hip-python"))]


@pytest.fixture
def root(shm_root: Path) -> Path:
    """The store root of these tests: tests/unit/conftest.py's shm_root."""
    return shm_root


@gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_device_snapshots_are_the_state_after_their_step(root: Path, backend: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.Tanh(), torch.nn.Linear(4096, 1024)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = Checkpointer(model, opt, Options(root=root, job_id="gpu", backend=backend, keep=3, chunk_bytes=1 << 20,
                                            max_inflight_bytes=4 << 20))
    # the chunk crcs from the device's kernel where triton is (the restore below verifies them against the slot)
    assert ckpt.engine.copier.checksums == ("device" if available("triton") else "host")
    refs = {}
    for it in range(4):
        x = torch.randn(256, 1024, device="cuda")
        model(x).pow(2).mean().backward()
        opt.step()  # the next iteration's forward/backward overlaps this snapshot's copy
        opt.zero_grad()
        # a copy (.cpu() of a CPU tensor, e.g. AdamW's step counter, would alias the live value)
        refs[it + 1] = {e.name: e.local.detach().to("cpu", copy=True) for e in collect(model, opt, None)}
    ckpt.wait()
    for v in ckpt.store.versions():
        data = ckpt.store.slot(v.slot).array
        for e in v.manifest["entries"]:
            raw = torch.from_numpy(data[e["offset"]:e["offset"] + e["nbytes"]].copy())
            saved = raw.view(getattr(torch, e["dtype"])).view(e["shape"])
            assert torch.equal(saved, refs[v.step][e["name"]]), (v.step, e["name"])
    torch.manual_seed(1)
    model2 = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.Tanh(), torch.nn.Linear(4096, 1024)).cuda()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    ckpt.close()
    with Checkpointer(model2, opt2, Options(root=root, job_id="gpu", backend=backend)) as again:
        assert again.restore() == 4
        for e in collect(model2, opt2, None):
            assert torch.equal(e.local.cpu(), refs[4][e.name]), e.name


@gpu
def test_the_restore_bench_loads_the_host_store_into_the_gpu_bit_for_bit(root: Path) -> None:
    """`hpcft bench restore --device cuda`: every path restores into device memory, checked bitwise by the bench."""
    import json
    import subprocess
    import sys

    args = ["bench", "restore", "--device", "cuda", "--params", "1M", "--repeats", "1", "--json", "--root", str(root)]
    proc = subprocess.run([sys.executable, "-m", "hpcft.cli", *args], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["verified"] and result["config"]["device"] == "cuda" and result["restore_vs_memcpy"] > 0
