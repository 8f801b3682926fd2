"""The Checkpointer across real gloo ranks (separate processes, CPU): bitwise restore for DP, DP x TP
(DTensor) and FSDP2; SIGKILL mid-snapshot restores the previous snapshot, and that killed-and-relaunched run ends
bit-identical to an uninterrupted one."""
from pathlib import Path

import pytest
import torch

from multiproc import launch  # tests/ is on sys.path (tests/conftest.py, pytest's rootdir insertion)


@pytest.fixture
def root(shm_root: Path) -> Path:
    """The store root of these tests: tests/unit/conftest.py's shm_root."""
    return shm_root


def _reports(out: Path, name: str) -> list[dict]:
    import json

    return [json.loads(p.read_text()) for p in sorted(out.glob(f"{name}-rank*.json"))]


@pytest.mark.parametrize("kinds,tp", [("ddp,fsdp", 1), ("tp", 2)], ids=["dp4+fsdp2", "dp2xtp2"])
def test_restore_is_bitwise(kinds: str, tp: int, root: Path, tmp_path: Path) -> None:
    """DDP and FSDP2 on 4 ranks one after the other in one launch (each its own store), DP x TP in another."""
    launch.check(launch.run(4, "roundtrip", "--kind", kinds, "--tp", str(tp), root=root, out=tmp_path))
    reports = _reports(tmp_path, "roundtrip-run")
    assert len(reports) == 4
    for r in reports:
        assert r["kinds"].keys() == set(kinds.split(","))
        for kind in r["kinds"].values():
            assert kind["ok"] and kind["step"] == 3 and kind["mismatch"] == [] and kind["rng_equal"]
            assert kind["extra"] == {"pos": 3}


@pytest.mark.parametrize("world,groups", [(2, "hpcft"), (4, "hpcft"), (2, "user"), (4, "user")])
def test_groups_that_refuse_cpu_tensors(world: int, groups: str, root: Path, tmp_path: Path) -> None:
    """The documented flow (init, Checkpointer, restore, steps, relaunch, restore) on a default group that, like
    NCCL/RCCL, refuses CPU tensors: made by hpcft.init() or by the script itself with its own data-parallel group."""
    how = ["--backend", "cuda:gloo"] + (["--user-groups"] if groups == "user" else [])
    env = {"TORCH_GLOO_LAZY_INIT": "1"} if world == 4 else None  # as the GPU profiles set it (hpcft/launch/config/profiles.py)
    first = launch.run(world, "train", "--steps", "5", "--kill-at", "3", "--delay", "0.05", "--save-refs", *how,
                       root=root, out=tmp_path, extra_env=env)
    assert all(r.returncode == -9 for r in first), [r.output[-2000:] for r in first]
    launch.check(launch.run(world, "train", "--steps", "5", "--tag", "relaunch", *how, root=root, out=tmp_path,
                            extra_env=env))
    reports = _reports(tmp_path, "train-relaunch")
    assert len(reports) == world
    for r in reports:  # step 3's snapshot was in flight at the kill
        assert r["start"] == 2 and r["restored_equal"] and r["extra"] == {"pos": 2}


def test_sigkill_mid_snapshot_restores_previous_and_the_relaunch_ends_bit_identical(root: Path, tmp_path: Path) -> None:
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    launch.check(launch.run(2, "train", "--steps", "6", "--tag", "final", root=root, out=whole, job_id="a"))
    # a slow copy (many chunks, a delay each) is in flight when every rank kills itself after step 3
    killed = launch.run(2, "train", "--steps", "6", "--kill-at", "3", "--delay", "0.05", "--save-refs", root=root,
                        out=broken, job_id="b")
    assert [r.returncode for r in killed] == [-9, -9], [r.output[-2000:] for r in killed]
    launch.check(launch.run(2, "train", "--steps", "6", "--tag", "final", root=root, out=broken, job_id="b"))
    reports = _reports(broken, "train-final")
    assert len(reports) == 2
    for r in reports:  # the previous snapshot, equal to the state and RNG the killed run had after step 2
        assert r["start"] == 2 and r["restored_equal"] and r["extra"] == {"pos": 2}
    for rank in range(2):
        a = torch.load(whole / f"final-final-rank{rank}.pt")
        b = torch.load(broken / f"final-final-rank{rank}.pt")
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k


def test_one_ranks_damaged_store_makes_every_rank_fall_back_together(root: Path, tmp_path: Path) -> None:
    """Rank 1 alone holds an unusable data file (step 3) and a lying manifest (step 2): its StoreError and its
    manifest_bad are agreed on, so both ranks restore step 1 instead of one waiting in a collective for the other."""
    launch.check(launch.run(2, "damaged", root=root, out=tmp_path, timeout=120))
    reports = _reports(tmp_path, "damaged-run")
    assert [r["start"] for r in reports] == [1, 1] and all(r["ok"] for r in reports), reports
