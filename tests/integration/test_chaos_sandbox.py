"""`hpcft chaos` in the session's sandbox: faults of mixed kinds at an 8 s mean interval (seed 3: eleven due within
the first 53 s, so that at least eight land before 600 steps, ~55 s with their recoveries, however fast those are; a
shorter interval cascades, the faults due during each recovery coming back to back), the job submitted with spares
and XOR protection; every fault survived and the final parameters equal a fault-free run's."""
import json
import subprocess
import sys

import pytest

# the kinds that cost no requeue (the batch host's and two nodes' each add a minute of Slurm's requeue): CI's budget
MIX = ("rank_kill,node_crash,exception,hang,straggler,agent_kill,kill_in_snapshot,kill_in_protect,kill_in_flush,"
       "enospc,corrupt_chunk")


@pytest.mark.timeout(600)
def test_eight_mixed_faults_are_all_survived_and_the_result_is_bit_identical(healthy_sandbox, tmp_path):
    argv = [sys.executable, "-m", "hpcft.cli", "chaos", "--json", "--dir", str(healthy_sandbox.dir), "--keep",
            str(tmp_path / "runs"), "--mtbf", "8", "--faults", "8", "--seed", "3", "--mix", MIX, "--steps", "600",
            "--step-delay", "0.05", "--width", "64", "--layers", "2", "--repair-s", "5", "--hang-timeout", "5",
            "--persist-every", "10"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=580)
    assert done.stdout, done.stderr[-4000:]
    result = json.loads(done.stdout)
    story = done.stderr[-3000:]
    assert result["faults_injected"] >= 8, story
    assert result["faults_survived"] == result["faults_injected"], story
    assert result["final_equal"] is True, story
    assert 0 < result["goodput"] <= 1 and 0 <= result["goodput_baseline"] <= 1, result
    assert sum(k["count"] for k in result["kinds"].values()) == result["faults_injected"]
    timed = [f["recovery_s"] is not None for f in result["faults"] if "skipped" not in f]
    assert all(timed[:-1]), result["faults"]  # the last may have come with no step left to time it by
    assert result["curve"][-1][1] == result["steps"] - 1, result["curve"][-5:]  # the page's timeline, to the end
    assert done.returncode == 0, story
