"""`hpcft submit` + Slurm's warning signal in the sandbox: USR1 → requeue → the job runs again and finishes (a USR1
delivered again into the requeued run before its first step is recognised as stale and ignored);
and `hpcft clean` / slurm/epilog.sh keep a job's store while a requeue is pending, remove it afterwards."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcft import events
from hpcft.launch import progress

ROOT = Path(__file__).resolve().parents[2]
JOB = Path(__file__).parent / "jobs" / "train_dp.py"


def _env() -> dict[str, str]:
    return {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}


def _wait(predicate, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.2)


def _state(runner, job: str) -> str:
    out = runner.run(["scontrol", "show", "job", "-o", job], check=False).stdout
    return next((w.split("=", 1)[1] for w in out.split() if w.startswith("JobState=")), "GONE")


@pytest.mark.skipif(not JOB.exists(), reason="tests/integration/jobs/train_dp.py (the lead's DP job) is missing")
def test_warning_signal_requeues_and_the_job_finishes_in_its_next_run(healthy_sandbox, tmp_path):
    runner = healthy_sandbox.runner()
    out = tmp_path / "out"
    out.mkdir()
    job_dir = out / "job"
    submit = [sys.executable, "-m", "hpcft.cli", "submit", "--nodes", "4", "--spares", "2", "-t", "5", "--warn", "30",
              "--module", "", "--job-dir", str(job_dir), "--poll-interval", "0.5", "--requeue-margin", "30", "-o", str(out / "job.out"),
              "--", sys.executable, str(JOB)]
    env = {**_env(), "OUT": str(out), "STEPS": "14", "STEP_DELAY": "0.1",
           "SLURM_CONF": runner.env["SLURM_CONF"]}
    job = subprocess.run(healthy_sandbox.client_prefix() + submit, env={**os.environ, **env}, capture_output=True,
                         text=True, timeout=60)
    assert job.returncode == 0, job.stderr
    job_id = job.stdout.strip()
    _wait(lambda: progress.read(job_dir).get(0, (-1, 0))[0] >= 4, "step 4", 90)
    runner.run(["scancel", "--signal=USR1", "--batch", job_id])
    # Slurm signals a batch step by job id alone: a late or retried delivery of that signal lands in the requeued
    # run (seen once under load). Deliver one on purpose as soon as the requeued run starts, before its first step.
    _wait(lambda: len([e for e in events.read(job_dir) if e["event"] == "start"]) == 2, "the requeued run", 90)
    runner.run(["scancel", "--signal=USR1", "--batch", job_id])
    _wait(lambda: _state(runner, job_id) in ("COMPLETED", "FAILED", "GONE"), "the requeued job to end", 150)
    assert _state(runner, job_id) == "COMPLETED", (out / "job.out").read_text()[-3000:]
    recs = events.read(job_dir)
    decisions = [(e["action"], e["cause"]) for e in recs if e["event"] == "decision"]
    assert decisions == [("requeue", "walltime"), ("done", "success")], (out / "job.out").read_text()[-3000:]
    starts = [e for e in recs if e["event"] == "start"]
    assert [s["requeues"] for s in starts] == [0, 1]
    signals = [(e["meaning"], e.get("ignored", False)) for e in recs if e["event"] == "signal"]
    assert signals == [("walltime warning", False), ("stale", True)]
    assert any(e["event"] == "persist" and e["done"] is False for e in recs)  # no persistent flush yet (agents)
    assert (out / "final.pt").exists()


def test_clean_and_epilog_keep_the_store_while_a_requeue_is_pending(sandbox, tmp_path):
    runner = sandbox.runner()
    held = runner.run(["sbatch", "--parsable", "--hold", "--wrap", "true"]).stdout.strip()
    try:
        store = tmp_path / f"hpcft-someone-{held}"
        store.mkdir()
        clean_cmd = sandbox.client_prefix() + [sys.executable, "-m", "hpcft.cli", "clean", "--job", held, "--user",
                                               "someone", "--root", str(tmp_path)]
        epilog = sandbox.client_prefix() + [str(ROOT / "slurm" / "epilog.sh")]
        env = {**sandbox.client_env(), "SLURM_JOB_ID": held, "SLURM_JOB_USER": "someone",
               "HPCFT_STORE_ROOT": str(tmp_path)}
        kept = subprocess.run(clean_cmd, env=env, capture_output=True, text=True, timeout=60)
        assert kept.returncode == 0 and "requeue is pending" in kept.stdout and store.exists()
        assert subprocess.run(epilog, env=env, timeout=60).returncode == 0 and store.exists()
        runner.run(["scancel", held])
        _wait(lambda: _state(runner, held) != "PENDING", "the cancel", 30)
        assert subprocess.run(epilog, env=env, timeout=60).returncode == 0
        assert not store.exists()
        store.mkdir()
        gone = subprocess.run(clean_cmd, env=env, capture_output=True, text=True, timeout=60)
        assert gone.returncode == 0 and "removed" in gone.stdout and not store.exists()
    finally:
        runner.run(["scancel", held], check=False)
