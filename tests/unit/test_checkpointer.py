"""The Checkpointer in one process on the real /dev/shm: fresh start, consistency under a slow copy
(and the racy copy it guards against), a flipped byte, ENOSPC, `every`, stats, the Options it is given."""
from pathlib import Path

import pytest
import torch

from hpcft import events
from hpcft.checkpointer import Checkpointer
from hpcft.errors import ConfigError, IntegrityError
from hpcft.options import Options
from hpcft.snapshot.copiers import CpuCopier
from hpcft.snapshot.state import collect


@pytest.fixture
def root(shm_root: Path) -> Path:
    """The store root of these tests: tests/unit/conftest.py's shm_root."""
    return shm_root


def _model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # changes every element


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, it: int) -> None:
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(it))
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _state(model, opt) -> dict[str, torch.Tensor]:
    return {e.name: e.local.clone() for e in collect(model, opt, None)}


def _saved(ckpt: Checkpointer, version) -> dict[str, torch.Tensor]:
    """Read a committed version straight from the store (no restore): what the snapshot holds."""
    data = ckpt.store.slot(version.slot).array
    out = {}
    for e in version.manifest["entries"]:
        raw = data[e["offset"]:e["offset"] + e["nbytes"]].copy()
        out[e["name"]] = torch.from_numpy(raw).view(getattr(torch, e["dtype"])).view(e["shape"])
    return out


def _kinds(tmp: Path) -> list[str]:
    return [e["event"] for e in events.read(tmp / "events")]


def test_fresh_run_restores_zero(root: Path) -> None:
    model, opt = _model()
    with Checkpointer(model, opt, Options(root=root, job_id="j")) as ckpt:
        assert ckpt.restore() == 0 and ckpt.extra is None and not opt.state  # no optimizer state invented


def test_a_warm_up_pass_before_restore_keeps_its_gradients_and_the_restore_is_exact(root: Path) -> None:
    """Gradients present at restore (DDP's throw-away pass, examples/ddp.py) once stopped torch's helper from making
    the optimizer state a restore copies into: the restore failed, blaming the data-parallel group."""
    model, opt = _model()
    with Checkpointer(model, opt, Options(root=root, job_id="j")) as ckpt:
        _step(model, opt, 0)
        want = _state(model, opt)
    model2, opt2 = _model(seed=9)
    model2(torch.ones(1, 32)).sum().backward()
    grads = [p.grad.clone() for p in model2.parameters()]
    with Checkpointer(model2, opt2, Options(root=root, job_id="j")) as again:
        assert again.restore() == 1
    assert all(torch.equal(want[k], v) for k, v in _state(model2, opt2).items())
    assert all(torch.equal(p.grad, g) for p, g in zip(model2.parameters(), grads))


@pytest.mark.parametrize("racy", [False, True], ids=["guarded", "racy-control"])
def test_snapshot_during_next_step_is_the_state_after_its_step(root: Path, racy: bool) -> None:
    model, opt = _model()
    ckpt = Checkpointer(model, opt, Options(root=root, job_id="j", chunk_bytes=1024, keep=3, overlap=True))
    if racy:  # the trap: a copy that the next optimizer step does not wait for (pytorch #144657's shape)
        class Racy(CpuCopier):
            def guard(self, transfer) -> None:
                pass
        ckpt.engine.copier = Racy(threads=1)
    ckpt.engine.copier._delay_per_chunk = 0.01  # the test seam: a copy slow enough for the next step to overlap it
    refs = {}
    for it in range(4):
        _step(model, opt, it)  # the next forward/backward runs while the previous snapshot copies
        refs[it + 1] = _state(model, opt)
    ckpt.wait()
    versions = ckpt.store.versions()
    assert [v.step for v in versions] == [1, 2, 3, 4]
    equal = [all(torch.equal(refs[v.step][k], t) for k, t in _saved(ckpt, v).items()) for v in versions]
    ckpt.close()
    if racy:
        assert not all(equal)  # the test sees a mixed snapshot when nothing orders the copy
    else:
        assert all(equal)


def test_flipped_byte_falls_back_with_event(root: Path, tmp_path: Path) -> None:
    model, opt = _model()
    ckpt = Checkpointer(model, opt, Options(root=root, job_id="j"), extra=lambda: {"pos": 1})
    refs = {}
    for it in range(3):
        _step(model, opt, it)
        refs[it + 1] = _state(model, opt)
    ckpt.wait()
    newest = ckpt.store.versions()[-1]
    entry = newest.manifest["entries"][0]
    ckpt.store.slot(newest.slot).array[entry["offset"] + 5] ^= 0x40  # one bit of the first weight, in shm
    ckpt.close()
    model2, opt2 = _model(seed=9)
    with Checkpointer(model2, opt2, Options(root=root, job_id="j")) as again:
        assert again.restore() == 2
        assert all(torch.equal(refs[2][k], v) for k, v in _state(model2, opt2).items())
    assert {"chunk_lost", "restore_fallback", "restore_done"} <= set(_kinds(tmp_path))


def test_flipped_padding_byte_is_a_lost_chunk(root: Path) -> None:
    """The bytes between two entries (64-byte alignment) are part of their chunk's crc32c too, so restore
    covers every byte of the file, not only the entries' bytes."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)  # a 60-byte weight: 4 bytes of padding after it
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ckpt = Checkpointer(model, opt, Options(root=root, job_id="j"))
    for it in range(2):
        _step_small(model, opt, it)
    refs = _state(model, opt)
    ckpt.wait()
    newest = ckpt.store.versions()[-1]
    entry = next(e for e in newest.manifest["entries"] if e["nbytes"] % 64)
    ckpt.store.slot(newest.slot).array[entry["offset"] + entry["nbytes"]] ^= 1
    ckpt.close()
    torch.manual_seed(5)
    model2 = torch.nn.Linear(5, 3)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    with Checkpointer(model2, opt2, Options(root=root, job_id="j")) as again:
        assert again.restore() == 1
        _step_small(model2, opt2, 1)
        assert all(torch.equal(refs[k], v) for k, v in _state(model2, opt2).items())


def _step_small(model: torch.nn.Module, opt: torch.optim.Optimizer, it: int) -> None:
    model(torch.randn(4, 5, generator=torch.Generator().manual_seed(it))).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def test_every_version_lost_raises(root: Path) -> None:
    model, opt = _model()
    ckpt = Checkpointer(model, opt, Options(root=root, job_id="j", keep=1))
    _step(model, opt, 0)
    ckpt.wait()
    for v in ckpt.store.versions():
        ckpt.store.slot(v.slot).array[v.manifest["entries"][0]["offset"]] ^= 1
    with pytest.raises(IntegrityError, match="restore failed"):
        ckpt.restore()
    ckpt.close()


@pytest.mark.parametrize(("field", "value"), [("every", 0), ("keep", 0), ("threads", 0), ("chunk_bytes", -1),
                                              ("max_inflight_bytes", 0), ("every", 1.5), ("backend", "cuda")])
def test_options_are_checked_when_made(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"Options.{field} "):
        Options(**{field: value})


def test_options_come_third_and_the_rest_by_keyword(root: Path) -> None:
    model, opt = _model()
    with pytest.raises(ConfigError, match="options must be an hpcft.Options"):
        Checkpointer(model, opt, lambda: {"pos": 1})  # the old positional `extra`
    with pytest.raises(ConfigError, match="auto snapshots need an optimizer"):
        Checkpointer(model, None, Options(root=root, job_id="j"))


def test_every_and_stats(root: Path) -> None:
    model, opt = _model()
    with Checkpointer(model, opt, Options(root=root, job_id="j", every=2)) as ckpt:
        for it in range(5):
            _step(model, opt, it)
        ckpt.wait()
        assert [v.step for v in ckpt.store.versions()] == [2, 4]
        s = ckpt.stats
        assert s.snapshots == 2 and s.bytes == 2 * s.last_bytes > 0 and s.last_step == 4
        assert s.blocked_s > 0 and s.copy_s > 0 and len(s.history) == 2


def test_enospc_training_continues(mount_tmpfs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPCFT_EVENT_DIR", str(tmp_path / "events"))
    mnt = mount_tmpfs("1600k")
    model, opt = _model()
    ckpt = Checkpointer(model, opt, Options(root=mnt, job_id="j"))
    _step(model, opt, 0)
    ref = _state(model, opt)
    for it in range(1, 4):  # the second slot does not fit: these snapshots are skipped
        _step(model, opt, it)
    ckpt.close()
    assert "snapshot_skipped" in _kinds(tmp_path) and "store_full" in _kinds(tmp_path)
    model2, opt2 = _model(seed=3)
    with Checkpointer(model2, opt2, Options(root=mnt, job_id="j")) as again:
        assert again.restore() == 1
        assert all(torch.equal(ref[k], v) for k, v in _state(model2, opt2).items())
