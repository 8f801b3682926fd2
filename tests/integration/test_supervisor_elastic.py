"""`hpcft run --elastic --elastic-grow` in the sandbox, the machine's shape (2 ranks per node, process groups that
refuse CPU tensors): 4 nodes, no spare, a node that is not the first crashes (and is drained, as a site's health check
would) → the job shrinks to 3 nodes instead of requeueing: the lost slot is rebuilt from parity on a survivor, the
protected step is flushed from memory to the durable tier in the 4-node layout, and the 6 ranks left reshard it. The
node is repaired (slurmd back, still in the job's allocation) and resumed with `scontrol update`: once it stayed
healthy for --grow-settle, the job grows back to 4 nodes: the 3-node job's newest step is flushed and the 8 ranks
reshard it. No protected step is lost, the data position (`extra`) is exact, and with --elastic-batch keep-global
(train_job.py BATCH=plan: a step's result does not depend on the replica count) the loss curve and the final
parameters equal a fault-free run's bit for bit."""
import json
import os
import subprocess
import sys

import pytest
from runs import (JOB, assert_same_result, decisions, finished_ok, newest_ready, resumed_from, start, wait,
                  wait_protected)

from hpcft import events
from hpcft.agent import status as agent_status

STEPS, HOLD_AT, HOLD_SHRUNK, PER_NODE = 10, 4, 7, 2
JOB_ENV = {"BATCH": "plan", "BACKEND": "cuda:gloo"}


def _losses(out) -> dict[int, float]:
    """step → rank 0's loss of it, the last launch's where a step ran twice."""
    rows = [json.loads(line) for line in (out / "timeline.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["what"] == "step" and r["rank"] == 0}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The fault-free run: one process, the 8 micro-batches of the 8-rank job per step (no Slurm needed: BATCH=plan's
    result does not depend on the replica count)."""
    out = tmp_path_factory.mktemp("elastic-reference")
    env = {**os.environ, "OUT": str(out), "STEPS": str(STEPS), "CKPT": "disk", "HPCFT_BASE_WORLD": "8", **JOB_ENV,
           "MASTER_PORT": "29613"}
    done = subprocess.run([sys.executable, str(JOB)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.timeout(900)  # two reshapes, each with its relaunch, on a loaded CI machine
def test_a_node_lost_without_spare_shrinks_the_job_from_memory_and_it_grows_back_when_the_node_returns(
        healthy_sandbox, reference, tmp_path):
    out = tmp_path / "elastic"
    hold, hold_shrunk = tmp_path / "go", tmp_path / "go-shrunk"
    slurm = healthy_sandbox.runner()
    proc = start(healthy_sandbox, out, 4, "--nodes", "4", "--spares", "0", "--tasks-per-node", str(PER_NODE),
                 "--elastic", "--min-nodes", "3", "--elastic-grow", "--grow-settle", "2", "--grow-every", "2",
                 "--slurm-check-every", "10",  # the returned node is seen on the slow timer (60 s by default)
                 per_node=PER_NODE, steps=STEPS, minutes=15, HOLD_AT=f"{HOLD_AT},{HOLD_SHRUNK}",
                 HOLD_FILE=f"{hold},{hold_shrunk}", **JOB_ENV)  # two reshapes outlast 5 min on a loaded 2-core box
    try:
        protected = wait_protected(out, slots=4, timeout=300, above=HOLD_AT)  # the newest snapshot (step numbers count
        # optimizer steps done: loop step HOLD_AT is snapshot HOLD_AT + 1)
        first = newest_ready(out / "job")  # the 4-node job's agents
        slots = next(e for e in events.read(out / "job") if e["event"] == "launch")["slots"].split(",")
        lost = slots[2]  # not the first: the batch host keeps the supervisor
        healthy_sandbox.crash_node(lost)
        slurm.run(["scontrol", "update", f"NodeName={lost}", "State=DRAIN", "Reason=hpcft test: crashed"])
        healthy_sandbox.restart_node(lost, wait=False)  # repaired at once (still in the allocation), drained
    finally:
        hold.touch()
    try:  # the 3-node job holds after HOLD_SHRUNK, its newest step protected; then the node returns to service
        held = [out / f"progress.{rank}" for rank in range(3 * PER_NODE)]
        wait(lambda: all(int(p.read_text() or -1) >= HOLD_SHRUNK for p in held), "the 3-node job's hold", 300,
             story=out)
        tag = [e["tag"] for e in events.read(out / "job") if e["event"] == "agents_ready"][-1]  # the 3-node job's
        wait_protected(out, tag=tag, slots=3, timeout=120, above=HOLD_SHRUNK)
        slurm.run(["scontrol", "update", f"NodeName={lost}", "State=RESUME"])
        wait(lambda: any(d["action"] == "grow" for d in decisions(out / "job")), "the grow", 120, story=out)
    finally:
        hold_shrunk.touch()
    log, made, output = finished_ok(proc, out, timeout=300)
    assert [d["action"] for d in made] == ["shrink", "grow", "done"], output[-4000:]
    assert (made[0]["cause"], made[0]["nodes_from"], made[0]["nodes_to"]) == ("node_failed", 4, 3)
    assert (made[1]["cause"], made[1]["nodes_from"], made[1]["nodes_to"]) == ("nodes_returned", 3, 4)
    (shrink,) = [e for e in log if e["event"] == "shrink"]
    assert shrink["ok"] and shrink["hosted"] == f"2:{slots[3]}" and shrink["source"] == "memory+parity", shrink
    # the newest protected step, from memory: no earlier flush existed (--persist-every 100), and it is the step
    # the lost node's agent last reported protected or newer
    lost_report = agent_status.read(out / "job" / "agents", first)[2]
    assert shrink["step"] == shrink["durable"] >= max(protected, lost_report["protected"])
    (grow,) = [e for e in log if e["event"] == "grow"]
    assert grow["ok"] and grow["returned"] == lost and grow["step"] == grow["durable"] == HOLD_SHRUNK + 1, grow
    assert any(e["event"] == "node_back" and e["node"] == lost for e in log)
    sources = [e for e in log if e["event"] == "restore_source" and e["source"] == "durable"]
    assert {(e["step"], e["path"].rsplit("-", 1)[1]) for e in sources} == {(s, str(s)) for s in (shrink["step"],
                                                                                                 grow["step"])}
    reshards = {(e["saved_world"], e["world"]) for e in log if e["event"] == "durable_reshard"}
    assert reshards == {(8, 6), (6, 8)}, reshards
    shrunk = [s for s in slots if s != lost]
    launches = [(e["slots"], e["world"]) for e in log if e["event"] == "launch"]
    assert launches == [(",".join(slots), 8), (",".join(shrunk), 6), (",".join(shrunk + [lost]), 8)]
    resumed = resumed_from(out)
    assert sorted(set(resumed.values())) == [shrink["step"], grow["step"]] and len(resumed) == 6 + 8, resumed
    assert shrink["step"] == HOLD_AT + 1 and not [e for e in log if e["event"] == "progress_lost"]  # the ranks held there
    (summary,) = [e for e in log if e["event"] == "summary"]
    assert "continues on 3 of 4 nodes" in summary["shrunk"] and summary["level"] == "WARNING"
    assert f"back on 4 nodes ({lost} returned) from step {grow['step']}" in summary["grown"], summary
    assert_same_result(out, reference)  # parameters bit for bit, and the data position: 8 micro-batches a step
    assert _losses(out) == _losses(reference)  # the loss curve goes on, the same
