"""The task wrapper, run for real: ranks from the slot layout, exec of the command, the node's progress reporter, the
gate of a node being rebuilt."""
import getpass
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from hpcft.launch.fabric.service import Fabric
from hpcft.launch.node import gate
from hpcft.launch.policy.layout import Layout
from hpcft.launch.node.srun import step_env


def _env(tmp_path, node: str, local: int, **extra) -> dict[str, str]:
    lay = Layout.plan(["n1", "n2", "n3"], spares=1, tasks_per_node=2)
    base = step_env(lay, job_id="77", restart_count=0, job_dir=str(tmp_path / "job"))
    return {**os.environ, **base, "SLURMD_NODENAME": node, "SLURM_LOCALID": str(local), **extra}


def test_wrapper_sets_slot_ranks_and_execs_the_command(tmp_path):
    code = "import os; print(os.getpid(), os.environ['RANK'], os.environ['HPCFT_RANK'], os.environ['LOCAL_RANK'])"
    env = _env(tmp_path, "n2", 1)
    del env["HPCFT_JOB_DIR"]
    proc = subprocess.run([sys.executable, "-m", "hpcft.launch.node.task", "--", sys.executable, "-c", code],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[1:] == ["3", "3", "1"]


def test_wrapper_reports_a_missing_command_and_a_foreign_node(tmp_path):
    missing = subprocess.run([sys.executable, "-m", "hpcft.launch.node.task", "--", "/no/such/cmd"],
                             env=_env(tmp_path, "n1", 0), capture_output=True, text=True, timeout=60)
    assert missing.returncode == 127 and "cannot run '/no/such/cmd'" in missing.stderr
    foreign = subprocess.run([sys.executable, "-m", "hpcft.launch.node.task", "--", "true"],
                             env=_env(tmp_path, "n3", 0), capture_output=True, text=True, timeout=60)
    assert foreign.returncode == 2 and "node n3 has no slot" in foreign.stderr


def _children_after(seconds: float) -> str:
    return (f"import os, time\ntime.sleep({seconds})\nprint(os.environ['HPCFT_PROGRESS_FILE'])\n"
            "print(open(f'/proc/{os.getpid()}/task/{os.getpid()}/children').read())")


def test_without_agents_the_nodes_first_task_reports_its_ranks_progress_over_the_network(tmp_path):
    """A run without agents: the first task of each node forks a reporter that sends the node's ranks' newest
    committed steps to the supervisor's report service (nothing written to the shared job directory), and dies with
    the task."""
    job = tmp_path / "shm" / f"hpcft-{getpass.getuser()}-77"
    for rank, step in ((2, 5), (3, 4), (4, 9)):  # rank 4 is slot 2's: not this node's to report
        (job / f"rank-{rank:05d}").mkdir(parents=True, mode=0o700)
        job.chmod(0o700)
        (job / f"rank-{rank:05d}" / "slot-0.json").write_text(json.dumps({"step": step, "timing": {"ready_s": 0.5}}))
    (tmp_path / "job").mkdir()
    fabric = Fabric(tmp_path / "job", emit=lambda *a, **k: None)
    fabric.start(None)
    try:
        env = _env(tmp_path, "n2", 0, HPCFT_STORE_ROOT=str(tmp_path / "shm"), **fabric.env(with_agents=False))
        proc = subprocess.run([sys.executable, "-m", "hpcft.launch.node.task", "--", sys.executable, "-c",
                               _children_after(2.5)], env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert {r: s[:2] for r, s in fabric.view.samples().items()} == {2: (5, 0.5), 3: (4, 0.5)}
    finally:
        fabric.close()
    target, *children = proc.stdout.split()
    assert target == str(job / "progress" / "rank-00002")  # $HPCFT_PROGRESS_FILE: node-local
    assert len(children) == 1
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{children[0]}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{children[0]}"), "the reporter must end with its task"
    assert sorted(p.name for p in (tmp_path / "job").iterdir()) == ["secret", "status.json"]


def test_with_agents_no_task_forks_a_reporter_and_only_the_first_task_of_a_node_would(tmp_path):
    (tmp_path / "shm").mkdir()
    for local, agents in ((0, "1"), (1, "0")):
        env = _env(tmp_path, "n2", local, HPCFT_STORE_ROOT=str(tmp_path / "shm"), HPCFT_REPORTS="127.0.0.1:9",
                   HPCFT_AGENTS_REPORT=agents)
        proc = subprocess.run([sys.executable, "-m", "hpcft.launch.node.task", "--", sys.executable, "-c",
                               _children_after(0)], env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert len(proc.stdout.split()) == 1, proc.stdout  # the progress file's path, no child


def test_a_gated_nodes_task_waits_for_the_agents_ready_file_and_an_ungated_one_does_not(tmp_path):
    """A relaunch onto a spare (node/gate.py): n2's tasks wait until the supervisor creates the file, n1's go on."""
    opened = tmp_path / "agents-ready-3"
    gated = gate.env(opened, ["n2"], timeout=30)
    cmd = [sys.executable, "-m", "hpcft.launch.node.task", "--", sys.executable, "-c", "print('ran')"]
    env = {node: {k: v for k, v in _env(tmp_path, node, 0, **gated).items() if k != "HPCFT_JOB_DIR"}
           for node in ("n1", "n2")}
    free = subprocess.run(cmd, env=env["n1"], capture_output=True, text=True, timeout=60)
    assert free.returncode == 0 and free.stdout.strip() == "ran", free.stderr
    waiting = subprocess.Popen(cmd, env=env["n2"], stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)
    assert waiting.poll() is None  # still at the gate
    opened.touch()
    assert waiting.wait(timeout=60) == 0 and waiting.stdout.read().strip() == "ran"


def test_a_gate_that_never_opens_ends_the_task_with_an_error():
    clock = iter(range(100)).__next__
    env = {**gate.env(Path("/nonexistent/agents-ready-1"), ["n2"], timeout=3), "SLURMD_NODENAME": "n2"}
    why = gate.wait(env, sleep=lambda _s: None, clock=lambda: float(clock()))
    assert why is not None and "not ready within 3 s" in why
    assert gate.wait({**env, "SLURMD_NODENAME": "n1"}) is None  # another node is not gated
