"""Supervisor faults found on a foreign cluster (issue 11), each reproduced in the sandbox: a restart from step 0
that looked like success, what the job output says without -v, a step Slurm refuses to create (a configuration
error: the run ends at once with Slurm's words, not after --max-restarts relaunches); an agent that dies while the
trainers run (the run would go on unprotected) is found by the supervisor and the agents restarted alone, the trainers
training on."""
import json
import os
import signal
import subprocess
import sys
import time

from runs import (assert_same_result, decisions, finish, finished_ok, newest_ready, start_spared, wait, wait_progress,
                  wait_protected)

from hpcft import events
from hpcft.agent import status as agent_status


def test_a_restart_from_step_0_after_a_node_loss_is_an_error_and_a_summary_line(healthy_sandbox, dp_reference,
                                                                               tmp_path):
    out = tmp_path / "lost"
    proc = start_spared(healthy_sandbox, out, "--protect", "none", delay=0.1, verbose=False,
                        HPCFT_LOST_PROGRESS_EXIT="")  # the default, which conftest.py turns off for the other runs
    wait_progress(out / "job", 2, 6)
    healthy_sandbox.crash_node("n3")
    code, output = finish(proc)
    assert code == 6, output[-4000:]  # the command finished, but the run lost progress: not a clean success
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
    assert summary[0]["exit_code"] == 6 and summary[0]["steps_lost"] == lost[0]["steps_lost"], summary
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
    # refused before any step: nothing ran, so no janitor either (a requeued run's snapshots stay in memory)
    assert [(e["event"], e.get("action"), e.get("cause")) for e in log] == [
        ("decision", "stop", "error"), ("summary", "stop", None)], log
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


def test_an_agent_killed_while_the_trainers_run_is_restarted_alone_while_the_trainers_keep_training(
        healthy_sandbox, dp_reference, tmp_path):
    out = tmp_path / "agent-kill"
    hold = out / "restarted"
    # the default options (xor over 4 nodes); the trainers hold after step 3 until the agents are back: the agents'
    # CPU cap (0.01 cores for CPU trainers) paces their rounds, and on CI's loaded 2 cores the 16 steps once ended
    # before the survivors' next round had noticed the loss
    proc = start_spared(healthy_sandbox, out, delay=0.4, verbose=False, HOLD_AT="3", HOLD_FILE=str(hold))
    try:
        wait_protected(out, slots=4, timeout=120, above=0)
        assert not (out / "final.pt").exists(), "the job ended before the agent was killed"
        os.kill(agent_status.read(out / "job" / "agents", newest_ready(out / "job"))[2]["pid"], signal.SIGKILL)  # n3's
        # agent, not its node
        wait(lambda: any(e["event"] == "agents_restart" for e in events.read(out / "job")),
             "the agents restarted alone", 180, story=out)
    finally:
        hold.touch()
    log, made, output = finished_ok(proc, out, timeout=240)
    assert [(d["action"], d["cause"]) for d in made] == [("done", "success")], output[-4000:]  # no relaunch
    failed = [e for e in log if e["event"] == "agents_failed"]
    assert len(failed) == 1 and failed[0]["level"] == "ERROR" and "restart alone" in failed[0]["action"], failed
    assert not [e for e in log if e["event"] == "node_bad"], "every node answered the probe"
    restarts = [e for e in log if e["event"] == "agents_restart"]
    assert len(restarts) == 1 and restarts[0]["ok"] and restarts[0]["trainers"] == "kept", restarts
    ready = [(e["tag"], e["rebuild"]) for e in log if e["event"] == "agents_ready"]
    assert ready == [("0", False), ("0-alone1", False)], ready  # the same nodes: nothing rebuilt
    assert [e["event"] for e in log].count("launch") == 1
    steps = [r for r in _timeline(out) if r["what"] == "step"]
    pids = {r["rank"]: {s["pid"] for s in steps if s["rank"] == r["rank"]} for r in steps}
    assert len(pids) == 4 and all(len(p) == 1 for p in pids.values()), pids  # every trainer kept its process
    summary = [e for e in log if e["event"] == "summary"]
    assert summary[0]["lost"] == "", summary
    assert_same_result(out, dp_reference)


def _timeline(out):
    return [json.loads(line) for line in (out / "timeline.jsonl").read_text().splitlines() if line.strip()]


def test_a_frozen_node_is_named_by_the_agents_heartbeats_and_confirmed_by_the_probe(healthy_sandbox, dp_reference,
                                                                                     tmp_path):
    """A node that stops answering without closing its connections (SIGSTOP of its slurmd and every process of it):
    its peers' heartbeats name it after --loss-timeout, the supervisor's probe (started once it was late, half that
    silent) confirms it, a spare takes its slot before Slurm marks it (SlurmdTimeout 10 s). A node paused for less
    than the timeout first is not named."""
    out = tmp_path / "freeze"
    loss = 2.0
    hold = tmp_path / "hold"  # the job waits after step 3 until it exists: the freeze must come before its end
    proc = start_spared(healthy_sandbox, out, "--loss-timeout", str(loss), delay=0.4, verbose=False,
                        HOLD_AT="3", HOLD_FILE=str(hold))
    wait_protected(out, slots=4, timeout=120, above=0)
    assert not (out / "final.pt").exists(), "the job ended before the node was frozen"
    healthy_sandbox.freeze_node("n2")  # slow but alive: paused for half the loss timeout
    time.sleep(loss / 2)
    healthy_sandbox.thaw_node("n2")
    time.sleep(loss)
    frozen = time.time()
    healthy_sandbox.freeze_node("n3")
    hold.touch()
    try:
        code, output = finish(proc, timeout=240)
    finally:
        healthy_sandbox.crash_node("n3")  # ends the frozen processes; the fixture restarts the node
    assert code == 0, output[-4000:]
    log = events.read(out / "job")
    made = [(d["action"], d["cause"]) for d in decisions(out / "job")]
    assert made == [("replace", "node_failed"), ("done", "success")], output[-4000:]
    assert made and decisions(out / "job")[0]["replaced"] == "n3:n5"
    silent = [e for e in log if e["event"] == "peer_silent"]
    assert silent and {e["peer_slot"] for e in silent} == {2}, silent  # n3's slot only: n2's pause was not a loss
    assert all(e["time"] - frozen >= loss and e["silent_s"] > loss for e in silent), silent
    bad = [e for e in log if e["event"] == "node_bad"]
    assert [(e["node"], e.get("found_by")) for e in bad] == [("n3", "agents")], bad
    # the probe's timeout, or Slurm's mark while the probe waited (it asks scontrol every second): both confirm it
    assert "silent" in bad[0]["suspected"], bad
    assert "probe did not answer" in bad[0]["state"] or "while the probe waited" in bad[0]["state"], bad
    heard = next(e for e in log if e["event"] == "agents_suspect" and "n3" in e["nodes"].split(","))
    late = next(e for e in log if e["event"] == "agents_late" and "n3" in e["nodes"].split(",") and e["time"] > frozen)
    assert late["time"] < heard["time"] and "(probed ahead)" in bad[0]["state"], (late, bad)  # the verdict was in
    print(f"\nfrozen node: late {late['time'] - frozen:.2f} s after the freeze (probed then), named by its peers "
          f"{min(e['time'] for e in silent) - frozen:.2f} s after (--loss-timeout {loss:g}), the supervisor told "
          f"{heard['time'] - frozen:.2f} s after, declared lost {bad[0]['time'] - frozen:.2f} s after "
          "(--probe-timeout 5)")
    assert_same_result(out, dp_reference)


def test_an_agents_step_that_ends_before_its_agents_are_ready_is_launched_once_more_and_the_run_goes_on(
        healthy_sandbox, dp_reference, tmp_path):
    """The agents' step of the first launch ends before its agents are ready, the nodes all answering (CI once saw
    srun exit 141 there: a task of it died of SIGPIPE): here its srun gets SIGPIPE, on which srun kills the step
    and exits. The step is launched once more before the trainers start; no relaunch, nothing lost."""
    out = tmp_path / "agents-again"
    proc = start_spared(healthy_sandbox, out, verbose=False)
    try:
        wait(lambda: _agents_srun(out) is not None, "the agents' srun, its tasks started", 60, story=out)
        os.kill(_agents_srun(out), signal.SIGPIPE)
        log, made, output = finished_ok(proc, out, timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert [(d["action"], d["cause"]) for d in made] == [("done", "success")], output[-4000:]  # no relaunch
    again = [e for e in log if e["event"] == "agents_again"]
    assert len(again) == 1 and again[0]["tag"] == "0" and again[0]["level"] == "WARNING", again
    assert [e["tag"] for e in log if e["event"] == "agents_ready"] == ["0-again"]
    assert [e["event"] for e in log].count("launch") == 1 and not [e for e in log if e["event"] == "node_bad"]
    assert_same_result(out, dp_reference)


def _agents_srun(out) -> int | None:
    """The pid of the first launch's agents' srun on this machine, once its tasks started (an `agent_start`: srun
    handles signals by then) and before its agents are ready; not its shepherd (a fork of srun with the same
    command line, which cancels the step when srun dies)."""
    said = [e["event"] for e in events.read(out / "job")] if (out / "job").is_dir() else []
    if "agents_ready" in said:
        raise AssertionError("the agents got ready before their srun could be signalled")
    if "agent_start" not in said:
        return None
    found: dict[int, int] = {}  # pid: parent pid
    for entry in os.listdir("/proc"):
        try:
            argv = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0") if entry.isdigit() else []
            if argv[:1] == [b"srun"] and b"--job-name=hpcft-agent" in argv and str(out).encode() in b" ".join(argv):
                found[int(entry)] = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
    return next((pid for pid, parent in found.items() if parent not in found), None)
