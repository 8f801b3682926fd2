"""What the sandbox tests share beyond the sandbox: one fault-free run of the 4-rank DP job, and one run of the
recovery bench whose kept runs are inspected by the tests of the recoveries it makes."""
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
from runs import FAULT_AT, STEPS, decisions, finish, start_spared

# A run that recovers but lost a step or two exits with `--lost-progress-exit` (6) by default; these tests judge a
# loss by its events and summary, so their runs exit 0 on it. test_supervisor_faults.py's restart from step 0 unsets
# it for its own run, and checks the default status.
os.environ.setdefault("HPCFT_LOST_PROGRESS_EXIT", "0")


class Bench(NamedTuple):
    report: dict  # the JSON object on stdout
    stderr: str   # the human table
    runs: Path    # rank-kill/, node-crash/, batch-host/, baseline/: each run's job/, timeline.jsonl and final.pt


@pytest.fixture(scope="session")
def dp_reference(sandbox, tmp_path_factory) -> Path:
    """The uninterrupted run of the DP job (runs.STEPS steps, 4 ranks on n1..n4, 2 spares) on `hpcft run`'s default
    options, without -v: every test that compares a 4-rank run with a fault-free one compares it with this one (its
    output directory; final.pt is rank 0's parameters), made once per session. Its events are also the test of the
    defaults (test_supervisor_faults.py)."""
    out = tmp_path_factory.mktemp("dp-reference")
    code, output = finish(start_spared(sandbox, out, verbose=False))
    assert code == 0, output[-4000:]
    assert [d["action"] for d in decisions(out / "job")] == ["done"], output[-4000:]
    return out


@pytest.fixture(scope="session")
def recovery_bench(sandbox, dp_reference, tmp_path_factory) -> Bench:
    """`hpcft bench recovery --json --keep DIR` once per session, on the DP job and model of `dp_reference` (16 steps,
    train_job.py's width 32 and 2 layers): its four recoveries (a killed rank, a crashed node — silent, as a power loss is: frozen, then killed once the
    supervisor decided —, a lost batch host (frozen, powered off once the janitors requeued),
    the torch.save + srun-again baseline; the requeue baseline is left out: Slurm's credential expiry adds its 10 s) are the runs the tests of those recoveries check, against that reference, instead of
    making each again. The bench heals the sandbox before and after. Tests using it take `timeout(900)`: the first
    one pays for the four runs."""
    keep = tmp_path_factory.mktemp("recovery-bench")
    argv = [sys.executable, "-m", "hpcft.cli", "bench", "recovery", "--json", "--dir", str(sandbox.dir),
            "--keep", str(keep), "--steps", str(STEPS), "--fault-at", str(FAULT_AT), "--step-delay", "0.1",
            "--width", "32", "--layers", "2", "--baseline", "relaunch", "--crash", "silent",
            "--reference", str(dp_reference)]  # the session's fault-free run: the bench makes none of its own
    done = subprocess.run(argv, capture_output=True, text=True, timeout=850)
    assert done.returncode == 0, done.stderr[-4000:]
    return Bench(json.loads(done.stdout), done.stderr, keep)
