"""hpcft's node probe against the real Slurm (hpcft/launch/node/nodecheck.py): a controller that stops answering for
longer than --probe-timeout (slurmctld busy with a big machine's steps: here it is stopped outright, past Slurm's
MessageTimeout, so the probe's srun gives up and is started again) does not make a healthy node bad, since the node
was never asked; a node whose slurmd is frozen is still bad at the timeout."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from hpcft.sandbox import procs

HELPER = Path(__file__).parent / "helpers" / "probe_nodes.py"
TIMEOUT = 4.0  # --probe-timeout of the probe under test (the controller's stop outlasts it and Slurm's MessageTimeout)
STOPPED_S = 7.0


def test_a_stopped_controller_is_not_a_bad_node_and_a_frozen_node_is_bad_at_the_timeout(healthy_sandbox, tmp_path):
    go, out = tmp_path / "go", tmp_path / "probes.jsonl"
    env = {"PROBE_GO": str(go), "PROBE_OUT": str(out), "PROBE_TIMEOUT": str(TIMEOUT), "PROBE_ROUNDS": "2"}
    proc = healthy_sandbox.runner().popen(["salloc", "-N2", "--nodelist=n[1-2]", "--no-kill", sys.executable,
                                           str(HELPER), "n1", "n2"], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True)
    ctld = healthy_sandbox.groups["slurmctld"]
    try:
        deadline = time.monotonic() + 60
        while proc.poll() is None and not (healthy_sandbox.node_states().get("n1", "").startswith(("alloc", "mix"))):
            assert time.monotonic() < deadline, "no allocation within 60 s"
            time.sleep(0.2)
        time.sleep(1.0)  # the helper's interpreter is up and waiting on the file
        procs.signal_members(ctld, signal.SIGSTOP)
        try:
            go.write_text("controller stopped\n")
            time.sleep(STOPPED_S)
        finally:
            procs.signal_members(ctld, signal.SIGCONT)
        _wait_lines(out, 1, proc)
        healthy_sandbox.freeze_node("n2")
        go.write_text("controller stopped\nn2 frozen\n")
        _wait_lines(out, 2, proc)
    finally:
        healthy_sandbox.thaw_node("n2")
        try:
            output, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
    stopped, frozen = [json.loads(line) for line in out.read_text().splitlines()]
    assert stopped["bad"] == {} and stopped["seconds"] >= STOPPED_S - 1.0, (stopped, output[-3000:])
    assert frozen["bad"] == {"n2": f"probe did not answer within {TIMEOUT:g} s"}, (frozen, output[-3000:])
    assert frozen["seconds"] < TIMEOUT * 2.5, frozen


def _wait_lines(path: Path, count: int, proc: subprocess.Popen, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and len(path.read_text().splitlines()) >= count):
        assert proc.poll() is None, f"the probing job ended early: {proc.communicate()[0][-3000:]}"
        assert time.monotonic() < deadline, f"no probe result {count} within {timeout} s"
        time.sleep(0.1)
