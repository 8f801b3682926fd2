"""Supervisor faults found on a foreign cluster (issue 11), each reproduced in the sandbox: a restart from step 0
that looked like success, what the job output says without -v, a step Slurm refuses to create (a configuration
error: the run ends at once with Slurm's words, not after --max-restarts relaunches); an agent that dies while the
trainers run (the run would go on unprotected) is found by the supervisor and the run relaunched with fresh agents."""
import os
import signal
import subprocess
import sys

from runs import assert_same_result, decisions, finish, start_spared, wait_progress, wait_protected

from hpcft import events
from hpcft.agent import status as agent_status


def test_a_restart_from_step_0_after_a_node_loss_is_an_error_and_a_summary_line(healthy_sandbox, dp_reference,
                                                                               tmp_path):
    out = tmp_path / "lost"
    proc = start_spared(healthy_sandbox, out, "--protect", "none", delay=0.1, verbose=False)
    wait_progress(out / "job", 2, 6)
    healthy_sandbox.crash_node("n3")
    code, output = finish(proc)
    assert code == 0, output[-4000:]
    made = decisions(out / "job")  # the spare takes the crashed node's slot, every rank keeps its role
    assert [d["action"] for d in made] == ["replace", "done"], output[-4000:]
    assert made[0]["cause"] == "node_failed" and made[0]["replaced"] == "n3:n5"
    assert made[0]["excluded"] == "n3" and made[0]["slots"] == "n1,n2,n5,n4"
    log = events.read(out / "job")
    assert {e["node"] for e in log if e["event"] == "node_bad"} == {"n3"}
    lost = [e for e in log if e["event"] == "progress_lost"]
    assert len(lost) == 1, output[-4000:]
    assert lost[0]["resumed_from"] == 0 and lost[0]["steps_lost"] >= 6 and lost[0]["level"] == "ERROR", lost
    assert "n3" in lost[0]["reason"] and "--protect none" in lost[0]["reason"], lost
    summary = [e for e in log if e["event"] == "summary"]
    assert len(summary) == 1 and summary[0]["action"] == "done" and "from step 0" in summary[0]["lost"], summary
    # what a person reads without -v: every decision, the loss and the summary
    for line in ("event=decision action=replace", "event=decision action=done", "event=progress_lost",
                 "event=summary"):
        assert line in output, f"{line!r} not in the job output:\n{output[-4000:]}"
    assert_same_result(out, dp_reference)  # from step 0, but right


def test_a_run_on_the_default_options_protects_and_its_summary_says_nothing_was_lost(dp_reference):
    log = events.read(dp_reference / "job")  # the shared fault-free run is made on the default options
    start = next(e for e in log if e["event"] == "start")
    assert start["protect"] == "xor" and start["group"] == 4, start  # 4 active nodes: xor over one set of 4
    assert [e["event"] for e in log].count("agents_ready") == 1
    summary = [e for e in log if e["event"] == "summary"]
    assert len(summary) == 1 and summary[0]["lost"] == "" and summary[0]["level"] == "INFO", summary
    stopped = [e for e in log if e["event"] == "agents_stopped"]
    assert stopped and [e["exit_code"] for e in stopped] == [0] * len(stopped), stopped  # asked to stop, not killed


def test_a_step_slurm_refuses_to_create_ends_the_run_at_once_with_slurms_message(sandbox, tmp_path):
    # the sandbox's nodes have 4 CPUs: 8 tasks per node is a configuration error, not a failure to retry
    argv = ["salloc", "-N2", "--no-kill", "-t", "5", sys.executable, "-m", "hpcft.cli", "run", "--job-dir",
            str(tmp_path / "job"), "--tasks-per-node", "8", "--protect", "none", "--poll-interval", "0.2", "--",
            "true"]
    proc = sandbox.runner().popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    code, output = finish(proc, timeout=90)
    assert code == 1, output[-3000:]  # EXIT_ERROR: fix the options and resubmit
    made = [(d["action"], d["cause"]) for d in decisions(tmp_path / "job")]
    assert made == [("stop", "step_refused")], output[-3000:]
    summary = [e for e in events.read(tmp_path / "job") if e["event"] == "summary"]
    assert len(summary) == 1 and "More processors requested than permitted" in summary[0]["reason"], summary
    assert [e["event"] for e in events.read(tmp_path / "job")].count("launch") == 1


def test_a_run_that_cannot_start_records_its_decision_and_summary(sandbox, tmp_path):
    argv = ["salloc", "-N2", "-t", "5", sys.executable, "-m", "hpcft.cli", "run", "--job-dir", str(tmp_path / "job"),
            "--nodes", "4", "--", "true"]
    proc = sandbox.runner().popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    code, output = finish(proc, timeout=90)
    assert code == 1, output[-3000:]
    log = events.read(tmp_path / "job")
    assert [(e["event"], e.get("action"), e.get("cause")) for e in log] == [
        ("decision", "stop", "error"), ("summary", "stop", None), ("cleaned", None, None)], log
    assert "need 4 nodes" in log[1]["reason"] and log[1]["level"] == "ERROR"


def test_snapshots_that_cannot_fit_the_nodes_memory_stop_the_run_before_launch(sandbox, tmp_path):
    """`--state-bytes` more than the nodes' memory can hold with its slots and parity: nothing is launched, and the
    reason gives the numbers and what to change."""
    argv = ["salloc", "-N3", "-t", "5", sys.executable, "-m", "hpcft.cli", "run", "--job-dir", str(tmp_path / "job"),
            "--state-bytes", "64G", "--node-memory", "128G", "--", "true"]
    proc = sandbox.runner().popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    code, output = finish(proc, timeout=90)
    assert code == 1, output[-3000:]
    log = events.read(tmp_path / "job")
    assert [e["event"] for e in log] == ["start", "decision", "summary", "cleaned"], log
    reason = log[1]["reason"]
    assert log[1]["action"] == "stop" and log[1]["level"] == "ERROR"
    # 3 nodes: --protect auto is xor over one set of 3, parity 1/2 of a snapshot
    assert reason.startswith("snapshots need 352.0 GiB per node = 4 snapshot slots (keep 2 + 1 + 1 pinned by the "
                             "agent) × 64.0 GiB + 3 xor records × 0.50 × 64.0 GiB"), reason
    assert "--node-memory offers 128.0 GiB, 102.4 GiB after the 20% headroom" in reason
    assert "at most 18.6 GiB per snapshot fits" in reason


def test_an_agent_killed_while_the_trainers_run_is_found_and_the_run_relaunched_with_fresh_agents(
        healthy_sandbox, dp_reference, tmp_path):
    out = tmp_path / "agent-kill"
    proc = start_spared(healthy_sandbox, out, delay=0.4, verbose=False)  # the default options: xor over 4 nodes
    wait_protected(out, slots=4, timeout=120, above=0)
    assert not (out / "final.pt").exists(), "the job ended before the agent was killed"
    os.kill(agent_status.read(out / "job" / "agents", "0")[2]["pid"], signal.SIGKILL)  # n3's agent, not its node
    code, output = finish(proc, timeout=240)
    assert code == 0, output[-4000:]
    log = events.read(out / "job")
    made = [(d["action"], d["cause"]) for d in decisions(out / "job")]
    assert made == [("relaunch", "agent_failed"), ("done", "success")], output[-4000:]
    failed = [e for e in log if e["event"] == "agents_failed"]
    assert len(failed) == 1 and failed[0]["level"] == "ERROR" and "relaunch" in failed[0]["action"], failed
    assert not [e for e in log if e["event"] == "node_bad"], "every node answered the probe"
    ready = [(e["tag"], e["rebuild"]) for e in log if e["event"] == "agents_ready"]
    assert ready == [("0", False), ("1", False)], ready  # the same nodes: every store holds its own snapshots
    summary = [e for e in log if e["event"] == "summary"]
    assert summary[0]["lost"] == "", summary  # resumed from memory
    assert_same_result(out, dp_reference)
