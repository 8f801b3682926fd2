"""The local Slurm sandbox, tested for real: slurmd per node, private /dev/shm, gloo and MPI across nodes,
idempotent start, clean failure, and a hard node crash with recovery."""
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from hpcft.errors import SandboxError
from hpcft.sandbox import Sandbox, SandboxConfig
from hpcft.sandbox import netns, procs
from hpcft.sandbox.config import OPEN_MPI_TCP_ENV, plan

pytestmark = pytest.mark.sandbox

HELPERS = Path(__file__).parent / "helpers"
FOUR = "--nodelist=n[1-4]"


def _hpcft(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hpcft.cli", *args], capture_output=True, text=True, timeout=120)


def _marked_processes(tag: str) -> list[int]:
    """Processes in a mount namespace carrying one of this sandbox's marker mounts."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            text = Path(f"/proc/{entry}/mountinfo").read_text() if entry.isdigit() else ""
        except OSError:
            continue
        if f" - tmpfs hpcft-{tag}-" in text and procs.alive(int(entry)):
            found.append(int(entry))
    return found


@pytest.fixture
def scratch_dir():
    """A sandbox directory outside pytest's 0700 tmp tree (munged, as user munge, must reach its socket)."""
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"hpcft-pytest-sandbox-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    yield path
    if (path / "state.json").exists():
        Sandbox.load(path).down()
    shutil.rmtree(path, ignore_errors=True)


def test_srun_runs_one_task_on_each_of_four_distinct_nodes(sandbox):
    out = sandbox.runner().run(["srun", "-N4", "--ntasks-per-node=1", "hostname"]).stdout.split()
    assert len(out) == 4
    assert len(set(out)) == 4
    assert set(out) <= set(sandbox.node_names)


def test_dev_shm_is_private_to_each_node(sandbox):
    runner = sandbox.runner()
    name = f"/dev/shm/hpcft-test-{uuid.uuid4().hex}"
    runner.run(["srun", "-w", "n1", "-N1", "-n1", "sh", "-c", f"echo data > {name}"])
    try:
        seen_n2 = runner.run(["srun", "-w", "n2", "-N1", "-n1", "test", "-e", name], check=False)
        seen_n1 = runner.run(["srun", "-w", "n1", "-N1", "-n1", "test", "-e", name], check=False)
    finally:
        runner.run(["srun", "-w", "n1", "-N1", "-n1", "rm", "-f", name], check=False)
    assert seen_n2.returncode == 1, "a file in n1's /dev/shm must not exist on n2"
    assert seen_n1.returncode == 0, "later steps on n1 must see n1's /dev/shm"
    assert not Path(name).exists(), "the host's /dev/shm must not see a node's file"


def test_gloo_all_reduce_across_four_nodes(sandbox):
    out = sandbox.runner(timeout=180).run(
        ["srun", "-N4", FOUR, "--ntasks-per-node=1", sys.executable, str(HELPERS / "gloo_allreduce.py")]
    ).stdout
    lines = sorted(line for line in out.splitlines() if line.startswith("rank="))
    assert len(lines) == 4
    assert all(line.endswith("sum=10") for line in lines)
    assert all("master=n1 " in line for line in lines)
    assert {line.split()[1] for line in lines} == {"host=n1", "host=n2", "host=n3", "host=n4"}


def test_mpi4py_all_reduce_under_srun_pmix(sandbox):
    pytest.importorskip("mpi4py")
    out = sandbox.runner(timeout=180).run(
        ["srun", "-N4", FOUR, "--ntasks-per-node=1", "--mpi=pmix", sys.executable, str(HELPERS / "mpi_allreduce.py")],
        env=OPEN_MPI_TCP_ENV,
    ).stdout
    lines = sorted(line for line in out.splitlines() if line.startswith("rank="))
    assert len(lines) == 4
    assert all("size=4 " in line and line.endswith("sum=10") for line in lines)
    assert {line.split()[2] for line in lines} == {"host=n1", "host=n2", "host=n3", "host=n4"}


def test_up_twice_says_already_up_and_status_lists_nodes(sandbox):
    again = _hpcft("sandbox", "up", "--dir", str(sandbox.dir))
    assert again.returncode == 0, again.stderr
    assert "already up" in again.stdout
    status = _hpcft("sandbox", "status", "--dir", str(sandbox.dir))
    assert status.returncode == 0, status.stderr
    for name in sandbox.node_names:
        assert f"\n{name} " in status.stdout


def test_the_sandbox_keeps_accounts_so_a_job_slurm_resized_takes_updates_again(healthy_sandbox):
    """As on a production cluster (slurmdbd): sacct knows the jobs, and a job slurmctld has resized takes a second
    update at once; with accounting_storage/none it refuses every update after the first resize until the job ends."""
    from hpcft.slurm.state import job_info, keeps_accounts

    runner = healthy_sandbox.runner()
    assert keeps_accounts(runner)
    job = runner.run(["sbatch", "--parsable", "--no-kill", "-N3", "-o", "/dev/null", "--wrap", "sleep 300"]).stdout
    job = job.strip()
    try:
        deadline = time.monotonic() + 60
        while len(job_info(runner, job).nodes) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        held = job_info(runner, job).nodes
        for keep in (held[:2], held[:1]):
            started = time.monotonic()
            runner.run(["scontrol", "update", f"JobId={job}", f"NodeList={','.join(keep)}"])
            assert time.monotonic() - started < 3  # refused, it would take slurmctld's 5-s retry
            assert job_info(runner, job).nodes == keep
    finally:
        runner.run(["scancel", job], check=False)
    deadline = time.monotonic() + 30
    while job not in runner.run(["sacct", "-X", "-n", "-P", "-o", "jobid"]).stdout.split():
        assert time.monotonic() < deadline, "sacct does not know the job"
        time.sleep(0.5)


def test_a_sandbox_without_accounting_runs_no_slurmdbd(scratch_dir):
    from hpcft.slurm.state import keeps_accounts

    result = _hpcft("sandbox", "up", "-N", "1", "--no-accounting", "--dir", str(scratch_dir))
    assert result.returncode == 0 and "no accounting" in result.stdout, result.stderr
    sb = Sandbox.load(scratch_dir)
    assert not keeps_accounts(sb.runner()) and "slurmdbd" not in sb.groups
    assert "accounting:" not in _hpcft("sandbox", "status", "--dir", str(scratch_dir)).stdout


def test_port_in_use_is_named_and_nothing_is_left_behind(scratch_dir):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = _hpcft("sandbox", "up", "--mode", "local", "-N", "2", "--ctld-port", str(port), "--dir", str(scratch_dir))
    assert result.returncode == 1
    assert f"port {port} (slurmctld) is in use" in result.stderr
    assert not (scratch_dir / "state.json").exists()
    assert _marked_processes(SandboxConfig(dir=scratch_dir).tag) == []


def test_failed_start_rolls_back_what_it_started_and_only_that(scratch_dir):
    sb = Sandbox(plan(SandboxConfig(dir=scratch_dir, nodes=3)))
    squatter = sb.layout.node("n2").netns  # someone else's namespace where n2's should go
    subprocess.run(["ip", "netns", "add", squatter], check=True)
    try:
        with pytest.raises(SandboxError, match=f"network namespace {squatter} exists already"):
            sb.up(timeout=30)
        assert netns.exists(squatter), "rollback must not remove a namespace the sandbox did not create"
    finally:
        netns.delete([squatter])
    assert not (scratch_dir / "state.json").exists()
    assert _marked_processes(sb.config.tag) == []  # munged was running when n2 failed
    assert not netns.exists(sb.layout.ctld_netns)
    assert not netns.exists(sb.layout.node("n1").netns)


def test_node_crash_is_seen_by_slurm_and_restart_brings_it_back(healthy_sandbox):
    sb, node = healthy_sandbox, "n6"
    runner = sb.runner()
    marker = f"/dev/shm/hpcft-test-{uuid.uuid4().hex}"
    runner.run(["srun", "-w", node, "-N1", "-n1", "sh", "-c", f"echo data > {marker}"])
    step = runner.popen(["srun", "-w", node, "-N1", "-n1", "sleep", "300"],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        sb.wait_for([node], lambda s: s in ("mixed", "allocated"), "running a job", 30)
        deadline = time.monotonic() + 30
        while len(sb.node_pids(node)) < 3 and time.monotonic() < deadline:  # slurmd, slurmstepd, sleep
            time.sleep(0.05)
        killed = sb.crash_node(node)
        assert len(killed) >= 3
        assert not any(procs.alive(pid) for pid in killed)
        states = sb.wait_for([node], lambda s: s.endswith("*") or s.startswith("down"), "down or not responding", 60)
        assert states[node].endswith("*") or states[node].startswith("down")
        step.wait(timeout=60)  # the srun of `sleep 300` ends: its node is gone (srun's status varies)
    finally:
        if step.poll() is None:
            step.send_signal(signal.SIGKILL)
            step.wait()
    sb.restart_node(node)
    assert sb.node_states()[node] == "idle"
    lost = runner.run(["srun", "-w", node, "-N1", "-n1", "test", "-e", marker], check=False)
    assert lost.returncode == 1, "a crashed node's /dev/shm must be empty after restart"
