"""`hpcft run` for real in the 6-node sandbox (4 active + 2 spares) with the DP training job: a killed rank is
relaunched on the same nodes and resumes from local memory; a crashed node's slot is taken by a spare (with
--protect xor the node agents rebuild its snapshot there, the spare's ranks starting once they did, and every rank
resumes from memory); a hung rank is found by the watchdog, the step killed and relaunched; --max-restarts reached
ends with a summary.
All that finish must end with parameters bit-identical to an uninterrupted run. The killed rank and the crashed
node are the runs of the session's recovery bench (conftest.py), which makes exactly these recoveries."""
import json
import os
import signal
import subprocess
import sys

import pytest
from runs import FAULT_AT, agents_ready, assert_same_result, decisions, finished_ok, resumed_from, wait, wait_protected
from runs import finish as _finish
from runs import start
from runs import start_spared as _start

from hpcft import events
from hpcft.bench import timeline
from hpcft.agent import status as agent_status
from hpcft.launch.steps.stop import LOST_NODE_GRACE_S


def test_the_run_checks_its_memory_plan_with_every_nodes_real_snapshot_size(dp_reference):
    """No --state-bytes: the plan is checked once the first snapshot exists, from the four agents' reports of their
    node's memory (hpcft.nodemem in each agent's status); the sandbox's nodes have room."""
    plans = [e for e in events.read(dp_reference / "job") if e["event"] == "memory_plan"]
    assert plans[0]["checked"] is False and "first snapshot" in plans[0]["reason"]
    (checked,) = plans[1:]
    assert checked["level"] == "INFO" and checked["nodes"] == 4 and checked["state_bytes"] > 0
    assert checked["needed"] < checked["capacity"] and "4 snapshot slots (keep 2 + 1 + 1 pinned" in checked["plan"]


@pytest.mark.timeout(900)  # the session's recovery bench, if no test has made it yet
def test_killed_rank_is_relaunched_on_the_same_nodes_and_resumes_from_memory(recovery_bench, dp_reference):
    out = recovery_bench.runs / "rank-kill"  # the trainer of rank 2 (n3) SIGKILLed once every rank did step FAULT_AT
    made = decisions(out / "job")
    assert [d["action"] for d in made] == ["relaunch", "done"], made
    assert made[0]["cause"] == "task_failed" and "n3: task 2" in made[0]["failed_tasks"]
    launches = [e for e in events.read(out / "job") if e["event"] == "launch"]
    assert [e["slots"] for e in launches] == ["n1,n2,n3,n4"] * 2
    resumed = set(resumed_from(out).values())
    assert len(resumed) == 1 and resumed.pop() >= FAULT_AT, "every rank resumes from the same step, from local memory"
    assert_same_result(out, dp_reference)


@pytest.mark.timeout(900)  # the session's recovery bench, if no test has made it yet
def test_crashed_node_is_rebuilt_on_the_spare_by_the_agents_and_every_rank_resumes_from_memory(recovery_bench,
                                                                                               dp_reference):
    out = recovery_bench.runs / "node-crash"  # --protect xor; n3 crashed once every agent protected step FAULT_AT + 1
    made = decisions(out / "job")
    assert [d["action"] for d in made] == ["replace", "done"], made
    assert made[0]["replaced"] == "n3:n5" and made[0]["slots"] == "n1,n2,n5,n4"
    log = events.read(out / "job")
    assert next(e for e in log if e["event"] == "start")["group"] == 4  # xor over the 4 active nodes
    ready = [e for e in log if e["event"] == "agents_ready"]
    assert [(e["tag"], e["rebuild"]) for e in ready] == [("0", False), ("1", True)], ready
    assert ready[1]["rebuilt"] == "n5" and ready[1]["step"] >= FAULT_AT + 1
    assert not [e for e in log if e["event"] in ("agents_failed", "agents_no_checkpoint")]
    order = [e["event"] for e in log if e["event"] in ("agents_ready", "launch")]
    assert order == ["agents_ready", "launch", "launch", "agents_ready"], \
        "a first launch's trainers wait for its agents; a rebuild's start with them"
    assert [e.get("gated") for e in log if e["event"] == "launch"] == [None, "n5"]
    # n5's rank (slot 2) runs its command only once the agents rebuilt its snapshot there: the gate held it
    relaunched = [r for r in timeline.read(out) if r["what"] == "start" and r["run"] == "0.1"]
    assert min(r["t"] for r in relaunched if r["rank"] == 2) >= ready[1]["time"], relaunched
    assert (out / "job" / "secret").stat().st_mode & 0o777 == 0o600
    resumed = resumed_from(out)
    assert len(resumed) == 4 and set(resumed.values()) == {ready[1]["step"]}, resumed
    assert_same_result(out, dp_reference)


def test_no_progress_within_the_hang_timeout_kills_relaunches_then_gives_up(sandbox, tmp_path):
    argv = ["salloc", "-N2", "--no-kill", "-t", "5", sys.executable, "-m", "hpcft.cli", "-v", "run",
            "--job-dir", str(tmp_path / "job"), "--poll-interval", "0.2", "--kill-grace", "1", "--hang-timeout", "2",
            "--max-restarts", "1", "--", "sleep", "60"]
    proc = sandbox.runner().popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    code, output = _finish(proc, timeout=90)
    assert code == 3, output[-3000:]  # EXIT_GAVE_UP: do not requeue
    made = [(d["action"], d["cause"]) for d in decisions(tmp_path / "job")]
    assert made == [("relaunch", "hang"), ("stop", "hang")], output[-3000:]
    log = events.read(tmp_path / "job")
    assert [e["event"] for e in log].count("launch") == 2
    summary = [e for e in log if e["event"] == "summary"]
    assert len(summary) == 1 and summary[0]["restarts"] == 1 and "--max-restarts 1" in summary[0]["reason"]


def test_a_hung_rank_is_detected_killed_and_the_job_resumes_from_memory(healthy_sandbox, dp_reference, tmp_path):
    out = tmp_path / "hang"
    # rank 1 goes silent after step 6 of the first launch; the others then wait in its all-reduce. --start-timeout
    # covers each launch's start-up (~10 s on 2 loaded cores; 25 s and more seen with other sessions' jobs on the
    # same cores: importing torch alone took 16 s), so the hang timeout itself can be short.
    proc = _start(healthy_sandbox, out, "--hang-timeout", "12", "--start-timeout", "120", HANG_AT="6", HANG_RANK="1")
    code, output = _finish(proc, timeout=300)
    assert code == 0, output[-4000:]
    made = decisions(out / "job")
    assert [(d["action"], d["cause"]) for d in made] == [("relaunch", "hang"), ("done", "success")], output[-4000:]
    resumed = set(resumed_from(out).values())
    assert len(resumed) == 1 and 0 < resumed.pop() <= 7, "every rank resumes from the snapshot of step 6 at the latest"
    assert_same_result(out, dp_reference)


@pytest.mark.parametrize("spares", [2, 0])
def test_a_drained_node_trains_on_and_after_a_failure_gives_its_slot_to_a_spare_or_keeps_it(
        healthy_sandbox, dp_reference, tmp_path, spares):
    """An admin's drain (or `scontrol reboot ASAP`) of a running node is no failure: the step goes on, once said
    (`node_closed`). When rank 0 then raises, the node check counts the drained node bad: a spare takes its slot and
    the agents rebuild it there; with no spare it keeps its slot (Slurm lets the job's new steps on it), rather than
    a requeue. Either way its agent (alive) is asked to stop, not killed, and every rank resumes from memory,
    bit-identical."""
    out = tmp_path / "drained"
    hold = out / "go"
    fault = dict(HOLD_AT="6", HOLD_FILE=str(hold), RAISE_AT="12", RAISE_RANK="0",
                 MAX_RESTARTS="0")  # no in-process restart: the step fails
    seen = ("--slurm-check-every", "10")  # a drain is seen on the slow timer (60 s by default): sooner here
    proc = _start(healthy_sandbox, out, "--protect", "xor", "--group", "4", *seen, **fault) if spares else \
        start(healthy_sandbox, out, 4, "--spares", "0", "--protect", "xor", "--group", "4", *seen, **fault)
    try:
        wait_protected(out, timeout=180)
        healthy_sandbox.runner().run(["scontrol", "update", "NodeName=n3", "State=DRAIN", "Reason=hpcft-test admin"])
        wait(lambda: any(e["event"] == "node_closed" and e["node"] == "n3" for e in events.read(out / "job")),
             "the supervisor to see the drain", 60, story=out)
    finally:
        hold.touch()
    log, made, output = finished_ok(proc, out, timeout=300)
    first = ("replace", "node_failed", "n3:n5") if spares else ("relaunch", "node_failed", "")
    assert [(d["action"], d["cause"], d["replaced"]) for d in made] == [first, ("done", "success", "")], output[-4000:]
    bad = [e for e in log if e["event"] == "node_bad"]
    assert [(e["node"], e["state"]) for e in bad] == [("n3", "MIXED+DRAIN")], bad
    stopped = next(e for e in log if e["event"] == "agents_stopped")
    assert stopped["how"] == "asked" and stopped["exit_code"] == 0, json.dumps(stopped)
    launches = [e["slots"] for e in log if e["event"] == "launch"]
    assert launches == ["n1,n2,n3,n4", "n1,n2,n5,n4" if spares else "n1,n2,n3,n4"], launches
    resumed = set(resumed_from(out).values())
    assert len(resumed) == 1 and resumed.pop() >= 7, "every rank resumes from the same step, from memory"
    if spares:
        ready = agents_ready(out / "job", "1")
        assert ready["rebuilt"] == "n5" and set(resumed_from(out).values()) == {ready["step"]}, json.dumps(ready)
    assert_same_result(out, dp_reference)


def test_a_node_lost_while_the_agents_rebuild_is_found_by_the_supervisor_not_by_slurm(healthy_sandbox, tmp_path):
    out = tmp_path / "startup"
    hold = out / "go"
    # a model of a few MB and a byte cap that make the rebuild take seconds; the first launch holds after step 6
    # until the agents have protected it (at that cap they could not keep up with the steps)
    proc = _start(healthy_sandbox, out, "--protect", "xor", "--group", "4", "--protect-rate", "300000",
                  WIDTH="512", HOLD_AT="6", HOLD_FILE=str(hold))
    protected = wait_protected(out, timeout=180)
    healthy_sandbox.crash_node("n3")  # n5 takes the slot; the agents rebuild it there before the trainers start
    hold.touch()
    rendezvous = out / "job" / "agents"
    wait(lambda: len(agent_status.read(rendezvous, "1")) == 4, "every agent of the rebuild to start", 120)
    assert agents_ready(out / "job", "1") is None, "the rebuild was over before the second crash"
    # n5 hangs while the agents get ready: stopped, not killed, so that no connection is reset (a crashed node
    # sends nothing either) and the other agents wait for it in their mesh, as on the foreign cluster
    for pid in healthy_sandbox.node_pids("n5"):
        os.kill(pid, signal.SIGSTOP)
    try:
        code, output = _finish(proc, timeout=300)
    finally:
        healthy_sandbox.crash_node("n5")  # the healthy_sandbox fixture then restarts it
    assert code == 0, output[-4000:]
    made = decisions(out / "job")
    assert [(d["action"], d["replaced"]) for d in made] == [("replace", "n3:n5"), ("replace", "n5:n6"),
                                                            ("done", "")], output[-4000:]
    # found by the supervisor's probe or its scontrol check (NOT_RESPONDING), not once Slurm declared it DOWN
    # (which ends the agents' step, as a fixed wait for the mesh would)
    bad = [e for e in events.read(out / "job") if e["event"] == "node_bad" and e["node"] == "n5"]
    assert bad and not any("DOWN" in e["state"] for e in bad), bad
    # as while training (#34: this cost ~25 s): the agents' suspect probed beside controls, not at --probe-timeout,
    # and the broken agents' step killed at once, not asked to stop for --kill-grace
    assert "other node(s) answered within" in bad[0]["state"] and bad[0].get("found_by") == "agents", bad
    stopped = next(e for e in events.read(out / "job") if e["event"] == "agents_stopped" and e["time"] > bad[0]["time"])
    assert stopped["how"] == "killed" and stopped["time"] - bad[0]["time"] < LOST_NODE_GRACE_S + 1, stopped
    ready = agents_ready(out / "job", "2")
    assert ready["rebuilt"] == "n6" and ready["step"] >= protected, ready
    assert set(resumed_from(out).values()) == {ready["step"]}
    # a newer step the agents had not protected yet is said to be that, not "lost members at positions [0, 1]"
    fallbacks = [e["reason"] for e in events.read(out / "job") if e["event"] == "rebuild_fallback"]
    assert all("not protected yet" in why for why in fallbacks), fallbacks
