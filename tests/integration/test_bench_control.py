"""`hpcft bench control --json` in the sandbox: a protected 4-node job at steady state asks slurmctld at most 2 RPCs a
minute (one `scontrol show node` of its slots per --slurm-check-every, 60 s by default, as sdiag counts them), and its
per-node processes' operations on the job directory are counted (strace) and modelled at 9,408 nodes."""
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.sandbox


@pytest.mark.timeout(600)  # the job's start, a short warm-up and a minute measured
def test_a_job_at_steady_state_asks_slurmctld_at_most_2_rpcs_a_minute_and_nothing_per_node_of_the_shared_fs(
        healthy_sandbox, tmp_path):
    done = subprocess.run([sys.executable, "-m", "hpcft.cli", "bench", "control", "--json", "--dir",
                           str(healthy_sandbox.dir), "--window", "60", "--warmup", "5",
                           "--keep", str(tmp_path / "kept")], capture_output=True, text=True, timeout=560)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout)
    assert report["slurm_rpcs_per_min"] <= 2, json.dumps(report["slurm_rpcs_by_type"])
    assert set(report["slurm_rpcs_by_type"]) <= {"REQUEST_NODE_INFO", "REQUEST_PARTITION_INFO"}, report
    assert report["met"]["slurm_rpcs_per_min"] is True
    assert report["window_s"] >= 60 and report["nodes"] == 4
    assert {"supervisor", "janitor", "agent", "standby"} <= set(report["processes"]), report["processes"]
    # nothing per node on the shared file system: the janitors ping the supervisor, the agents' requests come on
    # their uplinks (the durable flush's data writes are counted apart)
    assert report["shared_fs_ops_per_node_per_min"] == 0, json.dumps(report["fs_ops_by_kind"])
    assert report["shared_fs_ops_per_min_at_scale"] == 0
    assert report["slurm_rpcs_per_min_at_scale"] == report["slurm_rpcs_per_min"]  # one look of all slots per period
    assert "x N" in report["model"]["shared_fs_ops_per_min_at_scale"]
    # the supervisor writes the bounded log and the events (apart from the nodes' figure)
    assert report["supervisor_fs_ops_per_min"] > 0 and "rename .status.json.N" in report["fs_ops_by_kind"]["supervisor"]
    assert "shared-FS ops per node" in done.stderr  # the table goes to stderr with --json
