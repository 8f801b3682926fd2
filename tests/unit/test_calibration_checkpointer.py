"""The Checkpointer copies with the chosen method (HPCFT_COPY here, as a site pins it; the calibration's measurement is
tests/unit/test_calibration_cache.py's), explicit arguments win, and every method brings the state back bit for bit."""
from pathlib import Path

import pytest
import torch

from hpcft.checkpointer import Checkpointer
from hpcft.options import Options
from hpcft.snapshot import calibration, copiers
from hpcft.snapshot.calibration.policy import Method
from hpcft.store import ntcopy
from live_state import same, state_of  # tests/unit is on sys.path (pytest's rootdir insertion)


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 700), torch.nn.Tanh(), torch.nn.Linear(700, 300))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for it in range(steps):
        model(torch.randn(8, 300, generator=torch.Generator().manual_seed(it))).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("pinned", ["memcpy,threads=1,chunk=64K", "stream,threads=2,chunk=256K",
                                    "snapshot.kernel=memcpy,restore.kernel=stream,restore.threads=3,chunk=128K"])
def test_the_pinned_method_is_used_and_restores_bit_for_bit(shm_root: Path, monkeypatch: pytest.MonkeyPatch,
                                                           pinned: str) -> None:
    monkeypatch.setenv(calibration.ENV, pinned)
    model, opt = _model()
    with Checkpointer(model, opt, Options(root=shm_root, job_id="j", auto=False)) as ckpt:
        want = calibration.resolve(copiers.default_threads("cpu")).choice
        assert ckpt.copy_settings.snapshot == want.snapshot and ckpt.copy_settings.restore == want.restore
        assert ckpt.engine.chunk_bytes == want.snapshot.chunk_bytes
        assert ckpt.engine.copier.kernel == want.snapshot.kernel and ckpt.threads == want.snapshot.threads
        assert ckpt._loader.threads == want.restore.threads
        assert ckpt._loader.copy is ntcopy.raw_copier(want.restore.kernel)
        _train(model, opt, 2)
        ckpt.step(1)
        ckpt.wait()
        saved = state_of(model, opt)
        _train(model, opt, 1)
        assert not same(saved, state_of(model, opt))
        assert ckpt.restore() == 2 and same(saved, state_of(model, opt))
    model2, opt2 = _model()  # a relaunch: a new Checkpointer over the same store
    with Checkpointer(model2, opt2, Options(root=shm_root, job_id="j", auto=False)) as ckpt:
        assert ckpt.restore() == 2 and same(saved, state_of(model2, opt2))


def test_explicit_arguments_win_over_the_chosen_method(shm_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(calibration.ENV, "memcpy,threads=3,chunk=4M")
    model, opt = _model()
    with Checkpointer(model, opt, Options(root=shm_root, job_id="j", threads=1, chunk_bytes=512 << 10)) as ckpt:
        assert ckpt.copy_settings.snapshot == Method("memcpy", 1, 512 << 10)
        assert ckpt.copy_settings.restore == Method("memcpy", 1, 512 << 10)
        assert ckpt.engine.chunk_bytes == 512 << 10 and ckpt._loader.threads == 1
