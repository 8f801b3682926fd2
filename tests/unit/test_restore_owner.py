"""Whose snapshot a restore takes: only its own job's versions, unless told to adopt another job's (`adopt=`,
$HPCFT_ADOPT, `hpcft run --adopt JOB`). Another job's versions copied into this job's store are refused with an
error event and left in place (the agents' rebuild does the same: tests/unit/test_protect_barrier.py); the durable
tier, a directory the user names for later jobs, is read across jobs, and says so."""
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from hpcft import events
from hpcft.checkpointer import Checkpointer
from hpcft.launch import cli
from hpcft.launch.config import model as config
from hpcft.launch.config import resolve
from hpcft.options import Options
from hpcft.store import RankStore, job_dir

from live_state import same, state_of  # tests/unit is on sys.path (pytest's rootdir insertion)
from multiproc.durable_read import flush_rank  # tests/ is on sys.path (tests/conftest.py)


def _model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
    for it in range(start, steps):
        model(torch.randn(2, 8, generator=torch.Generator().manual_seed(it))).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


def _events(tmp: Path, kind: str) -> list[dict]:
    return [e for e in events.read(tmp / "events") if e["event"] == kind]


def _rank_dir(root: Path, job: str) -> Path:
    return job_dir(root, job) / "rank-00000"


def _job_a(root: Path, steps: int = 3) -> dict:
    """Job `A` trains `steps` steps (keep=2: slots 0, 1, 2 hold steps 1, 2, 3); its state after the last."""
    model, opt = _model()
    with Checkpointer(model, opt, Options(root=root, job_id="A")) as ckpt:
        _train(model, opt, steps)
        ckpt.wait()
    return state_of(model, opt)


def _copy_slot(root: Path, k: int, to_job: str) -> list[Path]:
    """Job A's slot k (data and manifest) copied into `to_job`'s store, as a careless `cp` would."""
    dst = _rank_dir(root, to_job)
    copied = []
    for name in (f"slot-{k}.data", f"slot-{k}.json"):
        shutil.copy2(_rank_dir(root, "A") / name, dst / name)
        copied.append(dst / name)
    return copied


def test_another_jobs_version_copied_into_the_store_is_refused_and_left_in_place(shm_root: Path,
                                                                                 tmp_path: Path) -> None:
    _job_a(shm_root)
    model, opt = _model(1)
    with Checkpointer(model, opt, Options(root=shm_root, job_id="B")) as ckpt:  # job B's own step 1, in slot 0
        _train(model, opt, 1)
        ckpt.wait()
        mine = state_of(model, opt)
    copied = _copy_slot(shm_root, 2, "B")  # job A's step 3
    model, opt = _model(5)
    with Checkpointer(model, opt, Options(root=shm_root, job_id="B")) as ckpt:
        assert ckpt.restore() == 1 and same(state_of(model, opt), mine)  # its own step, not A's newer one
    (refused,) = _events(tmp_path, "restore_foreign")
    assert refused["level"] == "ERROR" and refused["job"] == "A" and refused["steps"] == "3"
    assert "--adopt A" in refused["advice"] and "HPCFT_ADOPT=A" in refused["advice"]
    assert all(p.exists() for p in copied)  # never loaded, never deleted
    assert not _events(tmp_path, "version_withdrawn")


def test_only_another_jobs_versions_in_memory_restart_from_step_0(shm_root: Path, tmp_path: Path) -> None:
    _job_a(shm_root)
    RankStore("B", 0, root=shm_root).close()
    _copy_slot(shm_root, 2, "B")
    model, opt = _model(5)
    with Checkpointer(model, opt, Options(root=shm_root, job_id="B")) as ckpt:
        assert ckpt.restore() == 0
    assert [e["level"] for e in _events(tmp_path, "restore_foreign")] == ["ERROR"]


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_adopt_takes_another_jobs_versions_and_says_so(shm_root: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    want = _job_a(shm_root)
    RankStore("B", 0, root=shm_root).close()
    _copy_slot(shm_root, 2, "B")
    if how == "environment":
        monkeypatch.setenv("HPCFT_ADOPT", "A")
    model, opt = _model(5)
    with Checkpointer(model, opt, Options(root=shm_root, job_id="B", adopt="A" if how == "argument" else None)) as ckpt:
        assert ckpt.restore() == 3 and same(state_of(model, opt), want)
    assert not _events(tmp_path, "restore_foreign")
    (adopted,) = _events(tmp_path, "restore_adopted")
    assert adopted["level"] == "WARNING" and adopted["job"] == "A" and adopted["step"] == 3
    assert adopted["source"] == "memory"


def test_adopting_another_job_still_refuses_a_third_ones(shm_root: Path, tmp_path: Path) -> None:
    _job_a(shm_root)
    RankStore("B", 0, root=shm_root).close()
    _copy_slot(shm_root, 2, "B")
    model, opt = _model(5)
    with Checkpointer(model, opt, Options(root=shm_root, job_id="B", adopt="C")) as ckpt:
        assert ckpt.restore() == 0
    assert [e["job"] for e in _events(tmp_path, "restore_foreign")] == ["A"]


def test_another_jobs_durable_checkpoint_is_taken_and_said(shm_root: Path, tmp_path: Path) -> None:
    persist = tmp_path / "persist"
    persist.mkdir()
    model, opt = _model()
    with Checkpointer(model, opt, Options(root=shm_root, job_id="A")) as ckpt:
        _train(model, opt, 2)
        ckpt.wait()
        flush_rank(ckpt.store, ckpt.store.versions()[-1], persist, world=1, job="A")
    want = state_of(model, opt)
    model, opt = _model(5)
    with Checkpointer(model, opt, Options(root=shm_root, job_id="B", persist_dir=persist)) as ckpt:
        assert ckpt.restore() == 2 and same(state_of(model, opt), want)
    (adopted,) = _events(tmp_path, "restore_adopted")
    assert adopted["level"] == "WARNING" and adopted["job"] == "A" and adopted["source"] == "durable"
    assert "durable" in adopted["reason"]
    assert not _events(tmp_path, "restore_foreign")


def test_a_jobs_own_versions_restore_without_a_word_about_owners(shm_root: Path, tmp_path: Path) -> None:
    want = _job_a(shm_root)
    model, opt = _model(5)
    with Checkpointer(model, opt, Options(root=shm_root, job_id="A", adopt="Z")) as ckpt:
        assert ckpt.restore() == 3 and same(state_of(model, opt), want)
    assert not _events(tmp_path, "restore_foreign") and not _events(tmp_path, "restore_adopted")


def test_hpcft_run_adopt_reaches_the_trainers_and_the_agents(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    unset = config.load({}, environ={})
    assert unset.launch.adopt is None and "HPCFT_ADOPT" not in resolve.copy_env(unset)
    cfg = config.load({"adopt": "4242"}, environ={"HPCFT_ADOPT": "17"})
    assert cfg.launch.adopt == "4242" and resolve.copy_env(cfg)["HPCFT_ADOPT"] == "4242"
    assert config.load({}, environ={"HPCFT_ADOPT": "17"}).launch.adopt == "17"
    monkeypatch.chdir(tmp_path)
    out = CliRunner().invoke(cli.submit, ["--nodes", "2", "--dry-run", "--adopt", "4242", "--", "python", "t.py"])
    assert out.exit_code == 0, out.output
    assert "--adopt 4242" in out.output
    assert "--adopt" in CliRunner().invoke(cli.run, ["--help-all"]).output


def test_the_agents_flush_only_their_own_jobs_steps_into_its_durable_tier():
    """Another job's versions copied into every node's store are protected like any bytes, but a flush would write
    them into this job's durable tier, where a later restore would take them as this job's."""
    from types import SimpleNamespace

    from hpcft.agent.protection.bundle import owned
    from hpcft.store.owner import Owner

    def held(job):
        return {0: SimpleNamespace(manifest={"job_id": job}), 1: SimpleNamespace(manifest={"job_id": job})}

    complete = {1: held("7"), 2: held("A"), 3: {0: held("7")[0], 1: held("A")[1]}, 4: {0: SimpleNamespace(manifest={})}}
    assert sorted(owned(complete, Owner("7"))) == [1, 4]  # a manifest that records no job is not checked
    assert sorted(owned(complete, Owner("7", adopt="A"))) == [1, 2, 3, 4]
