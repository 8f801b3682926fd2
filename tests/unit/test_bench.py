"""Smoke runs of `hpcft bench snapshot|restore` on a tiny model: the output contract, never the timings."""
import json
import math
import subprocess
import sys

import pytest

from hpcft.store import ntcopy

SNAPSHOT_KEYS = {"overhead_hpcft", "overhead_torch_save", "overhead_dcp_async", "blocked_s_per_snapshot",
                 "copy_vs_memcpy", "dcp_async_form", "snapshot_bytes", "config", "variants", "copy_threads",
                 "copy_calibration", "machine"}
RESTORE_KEYS = {"restore_vs_memcpy", "restore_vs_memcpy_cold", "restore_vs_memcpy_prefetched", "prefetch_s",
                "restore_vs_memcpy_shm", "restore_vs_memcpy_shm_cold", "memcpy_shm_s", "memcpy_shm_fresh_s",
                "speedup_vs_dcp", "speedup_vs_torch_load", "verified", "state_bytes",
                "restore_threads", "copy_calibration", "machine"}


def calibrated_threads(result: dict, direction: str) -> int:
    """The copy method the bench's Checkpointer used; the suite pins it (tests/conftest.py: HPCFT_COPY=default)."""
    used = result["copy_calibration"]
    assert used["source"] == "override" and used[direction]["kernel"] in ntcopy.KERNELS
    assert {"cpu", "cores", "memcpy_gbps_1_thread", "load_average"} <= result["machine"].keys()
    return used[direction]["threads"]
TINY = ["--params", "1M", "--warmup", "1", "--threads", "1"]


def hpcft(*args: str, root) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpcft.cli", *args, "--root", str(root)],
                          capture_output=True, text=True, timeout=240)


def one_json_object(stdout: str) -> dict:
    """stdout must be exactly one JSON object (one line), nothing else."""
    lines = stdout.splitlines()
    assert len(lines) == 1, stdout
    obj = json.loads(lines[0])
    assert isinstance(obj, dict)
    return obj


@pytest.mark.slow
def test_snapshot_json_contract(tmp_path):
    proc = hpcft("bench", "snapshot", *TINY, "--steps", "2", "--json", root=tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = one_json_object(proc.stdout)
    assert SNAPSHOT_KEYS <= result.keys()
    for key in ("overhead_hpcft", "overhead_torch_save", "overhead_dcp_async", "blocked_s_per_snapshot",
                "copy_vs_memcpy"):
        assert isinstance(result[key], float) and math.isfinite(result[key]), key
    assert result["blocked_s_per_snapshot"] >= 0 and result["copy_vs_memcpy"] > 0
    assert "async_save" in result["dcp_async_form"]
    assert {v["n"] for v in result["variants"].values()} == {2}
    assert result["copy_threads"] == calibrated_threads(result, "snapshot")  # the reference memcpy's too
    assert "hpcft every step" in proc.stderr  # the table went to stderr
    assert list(tmp_path.iterdir()) == []  # the store dir was removed


@pytest.mark.slow
def test_restore_json_contract(tmp_path):
    proc = hpcft("bench", "restore", *TINY, "--repeats", "2", "--json", root=tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = one_json_object(proc.stdout)
    assert RESTORE_KEYS <= result.keys()
    assert result["verified"] is True
    for key in ("restore_vs_memcpy", "speedup_vs_dcp", "speedup_vs_torch_load", "restore_vs_memcpy_shm",
                "restore_vs_memcpy_shm_cold"):
        assert result[key] > 0, key
    assert result["restore_threads"] == calibrated_threads(result, "restore")
    assert list(tmp_path.iterdir()) == []


def test_table_on_stdout_without_json(tmp_path):
    proc = hpcft("bench", "restore", *TINY, "--repeats", "1", "--warmup", "0", root=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("hpcft bench restore")
    assert "speedup over dcp.load" in proc.stdout


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is visible: the bench would run on it")
@pytest.mark.parametrize("which", ["snapshot", "restore"])
def test_device_cuda_without_a_gpu_is_a_clear_error(tmp_path, which: str):
    proc = hpcft("bench", which, *TINY, "--device", "cuda", root=tmp_path)
    assert proc.returncode == 2 and "torch sees no CUDA/ROCm GPU here; use --device cpu" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_params_is_a_clear_error(tmp_path):
    proc = hpcft("bench", "snapshot", "--params", "lots", root=tmp_path)
    assert proc.returncode != 0
    assert "not a count" in proc.stderr and "Traceback" not in proc.stderr


def test_recovery_keep_refuses_a_directory_with_something_in_it(tmp_path):
    from hpcft.bench.recovery import RecoveryOptions
    from hpcft.errors import ConfigError

    RecoveryOptions(keep=str(tmp_path / "new"))  # a new or empty directory is fine
    RecoveryOptions(keep=str(tmp_path))
    (tmp_path / "rank-kill").mkdir()  # an earlier run's output
    with pytest.raises(ConfigError, match="is not empty"):
        RecoveryOptions(keep=str(tmp_path))


def test_a_failed_recovery_bench_keeps_the_sandboxs_logs_with_its_runs(tmp_path):
    """The bench's own sandbox goes with its end: on a failure its Slurm logs are copied beside the runs' output
    (a batch-host run once failed with nothing left to tell why). A log gone meanwhile is skipped."""
    from hpcft.bench.sandboxed import keep_logs

    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "slurmctld.log").write_text("ctld\n")
    (logs / "slurmd-n3.log").write_text("n3\n")

    class Logs:  # what keep_logs uses of a Sandbox
        def log_files(self):
            return [logs / "slurmctld.log", logs / "slurmd-n3.log", logs / "gone.log"]

    kept = keep_logs(Logs(), tmp_path / "runs" / "sandbox-logs")
    assert sorted(p.name for p in kept) == ["slurmctld.log", "slurmd-n3.log"]
    assert (tmp_path / "runs" / "sandbox-logs" / "slurmd-n3.log").read_text() == "n3\n"


def test_recovery_reference_must_be_a_finished_run_of_the_same_model(tmp_path):
    import torch

    from hpcft.bench.recovery import RecoveryOptions, identical
    from hpcft.errors import ConfigError

    with pytest.raises(ConfigError, match="no final.pt there"):
        RecoveryOptions(reference=str(tmp_path))
    runs = {}
    for name, width in (("ref", 4), ("same", 4), ("other", 8)):
        runs[name] = tmp_path / name
        runs[name].mkdir()
        torch.save({"seen": {"samples": 3}, "params": {"0.weight": torch.ones(width, width)}}, runs[name] / "final.pt")
    RecoveryOptions(reference=str(runs["ref"]))
    assert identical(runs["same"], runs["ref"])
    with pytest.raises(ConfigError, match="trained another model"):
        identical(runs["other"], runs["ref"])


def test_recovery_baselines_are_named_and_their_scripts_react_as_a_user_would(tmp_path):
    """Argument building only (the runs are the sandbox bench's): relaunch runs srun again in the same allocation,
    requeue asks Slurm; each first records when it reacted, under the run tag of the launch after it."""
    from hpcft.bench.recovery import RecoveryOptions
    from hpcft.bench.recovery_baselines import script
    from hpcft.errors import ConfigError

    with pytest.raises(ConfigError, match="--baseline takes relaunch or requeue"):
        RecoveryOptions(baselines=("restart",))
    relaunch, requeue = script("relaunch", tmp_path), script("requeue", tmp_path)
    assert relaunch.count("srun --kill-on-bad-exit=1") == 1 and "for launch in" in relaunch
    assert "scontrol requeue" not in relaunch and "--requeue" not in relaunch
    assert relaunch.index("&& exit 0") < relaunch.index('"what": "%s"') and '"0.$((launch + 1))"' in relaunch
    assert "#SBATCH -N4 --requeue" in requeue and 'scontrol requeue "$SLURM_JOB_ID"' in requeue
    for text in (relaunch, requeue):
        assert f">> {tmp_path}/timeline.jsonl" in text


def test_inprocess_phases_add_up_to_the_raise_to_first_step_time() -> None:
    """hpcft.bench.recovery.inprocess_phases over a made-up timeline: each phase ends when the last rank ends it."""
    from hpcft.bench.recovery import inprocess_phases

    records = [{"what": "raise", "t": 100.0, "rank": 2}] + [
        {"what": "step", "t": 101.5 + r / 10, "rank": r, "gen": 1} for r in range(4)]
    log = [{"event": "inprocess_restart", "generation": 1, "time": 101.0 + r / 100, "step": 6, "noticed_s": 0.1 * r,
            "torn_down_s": 0.2, "barrier_s": 0.1, "groups_s": 0.05, "restored_s": 0.05} for r in range(4)]
    ph = inprocess_phases(records, log)
    assert ph["total_s"] == pytest.approx(1.8) and ph["resumed_from"] == 6
    parts = ("detection_s", "abort_barrier_s", "new_groups_s", "restore_s", "first_step_s")
    assert sum(ph[p] for p in parts) == pytest.approx(ph["total_s"])
    assert ph["restore_s"] == pytest.approx(0.05) and ph["first_step_s"] == pytest.approx(0.77)


def test_the_protect_bench_measures_the_most_steps_a_node_loss_would_have_cost() -> None:
    from hpcft.bench.protect import steps_at_risk_max

    committed = {s: float(s) for s in range(1, 13)}  # a snapshot a second
    # passes complete at 3.5 (step 2), 5.5 (step 5), 10.5 (step 9, after a stall): before the last, 10 - 5 at risk
    assert steps_at_risk_max(committed, [(3.5, 2), (5.5, 5), (10.5, 9)]) == 5
    assert steps_at_risk_max(committed, [(3.5, 2)]) is None  # one pass measures nothing


def test_the_lag_of_a_real_job_is_judged_on_its_median_look_beside_the_unprotected_step() -> None:
    """`hpcft bench protect --dir` (bench/lag.py, measured on the confined sandbox by hand: a real job takes minutes):
    its figures from the looks at `hpcft status`'s view."""
    from hpcft.bench.lag import LagOptions, report

    looks = [{"t": float(t), "training": t, "at_risk": r, "warned": r > 3, "caps": [1.0 if r > 1 else 0.01],
              "budget": 0.01, "ceiling": 1.0} for t, r in enumerate([1, 2, 1, 5, 1, 0, 2])]
    got = report(looks, LagOptions(dir="/nowhere", params=1_000_000), {"n1": "2"}, 1.1, 1.0).as_dict()
    assert (got["steps_at_risk"], got["steps_at_risk_p95"], got["steps_at_risk_max"]) == (1, 5, 5)
    assert got["met"] == {"steps_at_risk": True}
    assert got["step_overhead"] == pytest.approx(0.1) and got["lag_warned_share"] == pytest.approx(1 / 7)
    assert got["cap_raised_share"] == pytest.approx(3 / 7) and got["layout"]["tasks_per_node"] == 2


def test_the_lag_bench_names_a_missing_sandbox(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hpcft.cli", "bench", "protect", "--dir", str(tmp_path)],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "no sandbox in" in proc.stderr and "Traceback" not in proc.stderr
