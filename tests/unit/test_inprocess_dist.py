"""In-process restart (hpcft.restartable) across 4 real gloo ranks: a raise in one rank restarts every rank in the
same process and ends bit-identical to an uninterrupted run; a second raise past the limit and a SIGKILLed rank
end every surviving rank non-zero with `inprocess_giveup`, within a bounded time."""
import json
from pathlib import Path

import pytest
import torch

from hpcft import events
from multiproc import launch

JOB = launch.SCENARIOS.with_name("inprocess_job.py")
STEPS = 6


@pytest.fixture
def root(shm_root: Path) -> Path:
    return shm_root


def _run(out: Path, root: Path, *args: str, job: str, backend: str | None = None, timeout: float = 180) -> list:
    how = ["--backend", backend] if backend else []
    return launch.run(4, "run", "--steps", str(STEPS), *args, *how, root=root, out=out, job_id=job, timeout=timeout,
                      script=JOB)


def _same(a: Path, b: Path) -> None:
    x, y = torch.load(a), torch.load(b)
    assert x.keys() == y.keys()
    for k in x:
        assert torch.equal(x[k], y[k]), k


@pytest.mark.parametrize("backend", [None, "cuda:gloo"], ids=["gloo", "cuda:gloo"])
def test_a_raise_restarts_every_rank_in_process_and_ends_bit_identical(backend, root: Path, tmp_path: Path) -> None:
    whole, faulted = tmp_path / "whole", tmp_path / "faulted"
    launch.check(_run(whole, root, "--tag", "ref", job="ref", backend=backend))
    launch.check(_run(faulted, root, "--tag", "f", "--raise-at", "3", "--raise-rank", "1", job="f", backend=backend))
    for rank in range(4):
        gens = json.loads((faulted / f"f-rank{rank}.json").read_text())
        assert [g["generation"] for g in gens] == [0, 1]
        assert len({g["pid"] for g in gens}) == 1  # the same process
        assert gens[1]["start"] == 3 and "injected fault at step 3" in gens[1]["cause"]
        _same(whole / f"final-ref-rank{rank}.pt", faulted / f"final-f-rank{rank}.pt")
    restarts = [e for e in events.read(faulted) if e["event"] == "inprocess_restart"]
    assert sorted(e["rank"] for e in restarts) == [0, 1, 2, 3]
    for e in restarts:
        assert e["generation"] == 1 and e["step"] == 3 and e["origin_rank"] == 1 and e["level"] == "WARNING"
        assert e["cause"] == "RuntimeError: injected fault at step 3"
        assert e["total_s"] > 0
    assert not [e for e in events.read(faulted) if e["event"] == "inprocess_giveup"]


def test_a_fault_past_the_limit_ends_every_rank_non_zero(root: Path, tmp_path: Path) -> None:
    res = _run(tmp_path, root, "--tag", "g", "--raise-at", "2", "--raise-gens", "0,1", "--max-restarts", "1", job="g")
    assert all(r.returncode == 1 for r in res), [r.output[-2000:] for r in res]
    assert all("GaveUp" in r.output for r in res)
    seen = events.read(tmp_path)
    assert sorted(e["rank"] for e in seen if e["event"] == "inprocess_restart") == [0, 1, 2, 3]
    gave_up = [e for e in seen if e["event"] == "inprocess_giveup"]
    assert sorted(e["rank"] for e in gave_up) == [0, 1, 2, 3]
    assert all(e["level"] == "ERROR" and e["generation"] == 1 for e in gave_up)
    assert any("limit reached (1)" in e["reason"] for e in gave_up)


def test_a_killed_rank_makes_the_survivors_give_up_in_bounded_time(root: Path, tmp_path: Path) -> None:
    """A rank that died cannot be restarted in process: the others' collectives fail, they wait at the barrier for
    --barrier-timeout, give up and exit non-zero (the supervisor's relaunch takes over), none hangs."""
    res = _run(tmp_path, root, "--tag", "k", "--kill-at", "2", "--kill-rank", "2", "--barrier-timeout", "5", job="k",
               timeout=120)
    assert res[2].returncode == -9
    survivors = [r for r in res if r.rank != 2]
    assert all(r.returncode == 1 for r in survivors), [r.output[-2000:] for r in survivors]
    gave_up = [e for e in events.read(tmp_path) if e["event"] == "inprocess_giveup"]
    assert sorted(e["rank"] for e in gave_up) == [0, 1, 3]


def test_the_bench_job_restarts_in_process_under_raise_at(root: Path, tmp_path: Path) -> None:
    """hpcft/bench/train_job.py's RAISE_AT knob (the recovery bench's in-process scenario) without Slurm: every rank
    restarts in process from the step it had and ends bit-identical to the same job without the raise."""
    from hpcft.bench import train_job

    def job(out: Path, **env: str) -> None:
        base = {"OUT": str(out), "STEPS": "8", "WIDTH": "16", "LAYERS": "2", **env}
        launch.check(launch.run(4, "job", root=root, out=out, job_id=out.name, script=Path(train_job.__file__),
                                extra_env=base))

    job(tmp_path / "whole")
    job(tmp_path / "raised", RAISE_AT="4", RAISE_RANK="2")
    _same_final(tmp_path / "whole" / "final.pt", tmp_path / "raised" / "final.pt")
    recs = [json.loads(line) for line in (tmp_path / "raised" / "timeline.jsonl").read_text().splitlines()]
    assert [r["rank"] for r in recs if r["what"] == "raise"] == [2]
    assert sorted(r["rank"] for r in recs if r["what"] == "restored" and r.get("gen") == 1) == [0, 1, 2, 3]
    assert {r["step"] for r in recs if r["what"] == "restored" and r.get("gen") == 1} == {4}
    assert len({r["pid"] for r in recs if r["what"] == "step" and r["rank"] == 2}) == 1


def _same_final(a: Path, b: Path) -> None:
    x, y = torch.load(a), torch.load(b)
    assert x["seen"] == y["seen"]
    for k in x["params"]:
        assert torch.equal(x["params"][k], y["params"][k]), k


def test_restarted_ranks_exit_cleanly_as_whole_interpreters(root: Path, tmp_path: Path) -> None:
    """As under srun (launch.py's forked ranks leave by os._exit): after a restart every rank's interpreter exits 0;
    a watcher thread left inside a store call at exit would abort it ("terminate called without an active
    exception")."""
    import os
    import subprocess
    import sys

    port = launch.free_port()
    procs = []
    for rank in range(4):
        env = {**os.environ, "HPCFT_RANK": str(rank), "HPCFT_WORLD_SIZE": "4", "HPCFT_LOCAL_RANK": str(rank),
               "HPCFT_LOCAL_WORLD_SIZE": "4", "HPCFT_JOB_ID": "whole", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "HPCFT_STORE_ROOT": str(root), "HPCFT_EVENT_DIR": str(tmp_path),
               "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(JOB), "run", "--out", str(tmp_path), "--steps", "4",
                                       "--raise-at", "2", "--tag", "w"], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], [o[-2000:] for o in outs]
    assert "terminate called" not in "".join(outs)
    assert len([e for e in events.read(tmp_path) if e["event"] == "inprocess_restart"]) == 4
