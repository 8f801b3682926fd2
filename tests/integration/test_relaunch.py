"""A 4-node job in the sandbox: every rank killed mid-run, relaunched on the same nodes, resumes from
node-local memory and ends bit-identical to an uninterrupted run (issue: snapshot engine)."""
import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch
from runs import JOB, STEPS, final  # the DP job and steps of the shared reference run (conftest.py)

pytestmark = pytest.mark.sandbox


def _allocate(runner) -> str:
    out = runner.run(["salloc", "-N4", "--nodelist=n[1-4]", "--no-shell"], timeout=60)
    m = re.search(r"Granted job allocation (\d+)", out.stdout + out.stderr)
    if not m:
        raise AssertionError(f"salloc gave no job id: {out.stderr}")
    return m.group(1)


def _srun(runner, job: str, out: Path, **env: str):
    argv = ["srun", f"--jobid={job}", "-N4", "--nodelist=n[1-4]", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
            sys.executable, str(JOB)]
    return runner.popen(argv, env={"OUT": str(out), "STEPS": str(STEPS), **env},
                        stdout=open(out / "srun.log", "ab"), stderr=__import__("subprocess").STDOUT)


def _progress(out: Path) -> int:
    steps = [int(p.read_text() or -1) for p in out.glob("progress.*")]
    return min(steps) if len(steps) == 4 else -1


def test_kill_all_ranks_and_relaunch_resumes_bit_identical(healthy_sandbox, dp_reference, tmp_path):
    runner = healthy_sandbox.runner(timeout=240)
    faulted = tmp_path / "faulted"
    faulted.mkdir()
    os.chmod(tmp_path, 0o755)

    job = _allocate(runner)
    try:
        # the kill comes once every rank has completed step 8: the delay leaves the other half of the steps to run
        first = _srun(runner, job, faulted, STEP_DELAY="0.25")
        deadline = time.monotonic() + 180
        while _progress(faulted) < 8:
            if first.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("the first launch ended or stalled: " + (faulted / "srun.log").read_text())
            time.sleep(0.2)
        runner.run(["scancel", "--signal=KILL", f"{job}.0"])  # every rank of the step, at an arbitrary point
        assert first.wait(timeout=60) != 0
        assert not (faulted / "final.pt").exists()

        second = _srun(runner, job, faulted)
        assert second.wait(timeout=240) == 0, (faulted / "srun.log").read_text()
    finally:
        runner.run(["scancel", job], check=False)

    starts = {p.name: int(p.read_text()) for p in faulted.glob("start.*")}
    relaunch = {name: s for name, s in starts.items() if s > 0}
    assert len(relaunch) == 4, f"all four ranks must resume from a snapshot: {starts}"
    assert len(set(relaunch.values())) == 1, f"ranks disagree on the step: {relaunch}"
    resumed = next(iter(relaunch.values()))
    assert 8 <= resumed <= STEPS

    a, b = final(dp_reference), final(faulted)  # the same job, uninterrupted
    assert a["seen"] == b["seen"]
    assert a["params"].keys() == b["params"].keys()
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), f"{name} differs after relaunch"
