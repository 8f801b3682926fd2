"""`hpcft clean` and slurm/epilog.sh keep a job's store while a requeue is pending and remove it afterwards;
slurm/prolog.sh sweeps the stores of jobs that ended or that Slurm forgot, and keeps the others. Run by hand against
the sandbox's slurmctld (the sandbox installs no prolog or epilog: Frontier users cannot)."""
import subprocess
import sys
from pathlib import Path

from runs import job_state, wait

from hpcft.store.paths import mark_run, marked_run

ROOT = Path(__file__).resolve().parents[2]



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
        wait(lambda: job_state(runner, held) != "PENDING", "the cancel", 30)
        # the end of a requeued run: Slurm's restart count (1) has moved past the run that wrote the store (0)
        mark_run(store, {"SLURM_RESTART_COUNT": "0"})
        assert marked_run(store) == 0
        requeued = {**env, "SLURM_JOB_RESTART_COUNT": "1"}
        assert subprocess.run(epilog, env=requeued, timeout=60).returncode == 0 and store.exists()
        # the end of the job: the run that wrote the store is the last one
        assert subprocess.run(epilog, env={**env, "SLURM_JOB_RESTART_COUNT": "0"}, timeout=60).returncode == 0
        assert not store.exists()
        store.mkdir()
        gone = subprocess.run(clean_cmd, env=env, capture_output=True, text=True, timeout=60)
        assert gone.returncode == 0 and "removed" in gone.stdout and not store.exists()
    finally:
        runner.run(["scancel", held], check=False)


def test_prolog_sweeps_the_stores_of_ended_or_forgotten_jobs_and_keeps_the_others(sandbox, tmp_path):
    runner = sandbox.runner()
    held = runner.run(["sbatch", "--parsable", "--hold", "--wrap", "true"]).stdout.strip()
    ended = runner.run(["sbatch", "--parsable", "-o", "/dev/null", "--wrap", "true"]).stdout.strip()
    try:
        wait(lambda: job_state(runner, ended) == "COMPLETED", "a job to end", 60)
        stores = {name: tmp_path / f"hpcft-some-one-{job}" for name, job in
                  (("pending", held), ("ended", ended), ("forgotten", "999999"), ("running", "424242"))}
        for path in stores.values():
            path.mkdir()
        env = {**sandbox.client_env(), "SLURM_JOB_ID": "424242", "HPCFT_STORE_ROOT": str(tmp_path)}
        prolog = sandbox.client_prefix() + [str(ROOT / "slurm" / "prolog.sh")]
        assert subprocess.run(prolog, env=env, timeout=60).returncode == 0
        assert {name for name, path in stores.items() if path.exists()} == {"pending", "running"}
    finally:
        runner.run(["scancel", held], check=False)
