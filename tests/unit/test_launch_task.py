"""The task wrapper, run for real: ranks from the slot layout, exec of the command, the progress watcher."""
import getpass
import json
import os
import subprocess
import sys
import time

from hpcft.launch import progress
from hpcft.launch.layout import Layout
from hpcft.launch.srun import step_env


def _env(tmp_path, node: str, local: int, **extra) -> dict[str, str]:
    lay = Layout.plan(["n1", "n2", "n3"], spares=1, tasks_per_node=2)
    base = step_env(lay, job_id="77", restart_count=0, job_dir=str(tmp_path / "job"))
    return {**os.environ, **base, "SLURMD_NODENAME": node, "SLURM_LOCALID": str(local), **extra}


def test_wrapper_sets_slot_ranks_and_execs_the_command(tmp_path):
    code = "import os; print(os.getpid(), os.environ['RANK'], os.environ['HPCFT_RANK'], os.environ['LOCAL_RANK'])"
    env = _env(tmp_path, "n2", 1)
    del env["HPCFT_JOB_DIR"]
    proc = subprocess.run([sys.executable, "-m", "hpcft.launch.task", "--", sys.executable, "-c", code],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[1:] == ["3", "3", "1"]


def test_wrapper_reports_a_missing_command_and_a_foreign_node(tmp_path):
    missing = subprocess.run([sys.executable, "-m", "hpcft.launch.task", "--", "/no/such/cmd"],
                             env=_env(tmp_path, "n1", 0), capture_output=True, text=True, timeout=60)
    assert missing.returncode == 127 and "cannot run '/no/such/cmd'" in missing.stderr
    foreign = subprocess.run([sys.executable, "-m", "hpcft.launch.task", "--", "true"],
                             env=_env(tmp_path, "n3", 0), capture_output=True, text=True, timeout=60)
    assert foreign.returncode == 2 and "node n3 has no slot" in foreign.stderr


def test_watcher_publishes_the_newest_committed_step_and_dies_with_the_task(tmp_path):
    store = tmp_path / "shm" / f"hpcft-{getpass.getuser()}-77" / "rank-00002"
    store.mkdir(parents=True)
    (store / "slot-0.json").write_text(json.dumps({"step": 4}))
    (store / "slot-1.json").write_text(json.dumps({"step": 5}))
    code = ("import os, sys, time\nfor _ in range(200):\n    time.sleep(0.05)\n    if open(sys.argv[1]).read() == '5': break\n"
            "print(open(f'/proc/{os.getpid()}/task/{os.getpid()}/children').read())")
    target = progress.progress_file(tmp_path / "job", 2)
    target.parent.mkdir(parents=True)
    target.write_text("0")
    env = _env(tmp_path, "n2", 0, HPCFT_STORE_ROOT=str(tmp_path / "shm"))
    proc = subprocess.run([sys.executable, "-m", "hpcft.launch.task", "--", sys.executable, "-c", code, str(target)],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert progress.read(tmp_path / "job")[2][0] == 5
    watchers = [int(p) for p in proc.stdout.split()]
    assert len(watchers) == 1
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{watchers[0]}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{watchers[0]}"), "the watcher must end with its task"


def test_a_relaunched_watcher_does_not_republish_the_step_the_file_already_holds(tmp_path):
    """A relaunch's ranks find their last snapshot in the store: publishing its step again would look like progress
    of the new launch while it starts up (--start-timeout would never apply)."""
    store = tmp_path / "shm" / f"hpcft-{getpass.getuser()}-77" / "rank-00002"
    store.mkdir(parents=True)
    (store / "slot-0.json").write_text(json.dumps({"step": 5}))
    target = progress.progress_file(tmp_path / "job", 2)
    target.parent.mkdir(parents=True)
    target.write_text("5")
    os.utime(target, (1_000_000, 1_000_000))
    code = "import time; time.sleep(1.5)"  # the watcher polls every second: at least one poll
    env = _env(tmp_path, "n2", 0, HPCFT_STORE_ROOT=str(tmp_path / "shm"))
    proc = subprocess.run([sys.executable, "-m", "hpcft.launch.task", "--", sys.executable, "-c", code],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert progress.read(tmp_path / "job")[2] == (5, 1_000_000)
