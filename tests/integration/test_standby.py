"""The warm standbys (on by default) in the session's runs: the recovery bench's killed rank and crashed node are
relaunched by the standbys' forked children, not new interpreters, and still end bit-identical to the fault-free
run; the spare's standby was warm before the crash. No run of its own: it reads the runs conftest.py makes."""
import pytest
from runs import FAULT_AT, assert_same_result, decisions, resumed_from

from hpcft import events
from hpcft.bench import timeline

pytestmark = pytest.mark.sandbox


def _launches(job_dir) -> list[list[dict]]:
    """The `trainer_start` events of each launch (split at the `launch` events)."""
    found: list[list[dict]] = []
    for e in events.read(job_dir):
        if e["event"] == "launch":
            found.append([])
        elif e["event"] == "trainer_start" and found:
            found[-1].append(e)
    return found


def test_the_reference_run_starts_every_rank_in_a_standby(dp_reference):
    log = events.read(dp_reference / "job")
    (launched,) = [e for e in log if e["event"] == "standby_launch"]
    assert launched["nodes"] == "n[1-6]", "a standby on every node of the slots and the spares"
    ready = {e["node"]: e for e in log if e["event"] == "standby_ready"}
    assert {f"n{i}" for i in range(1, 5)} <= ready.keys() and not any(ready[f"n{i}"]["spare"] for i in range(1, 5))
    # the spares' import yields to the active nodes' (their cores are this machine's two): in a run of a few
    # seconds they may still be importing at its end; the spare that takes a slot starts warm (test below)
    assert all(e["spare"] for n, e in ready.items() if n in ("n5", "n6"))
    (wait,) = [e for e in log if e["event"] == "standby_wait"]
    assert (wait["ready"], wait["nodes"], wait["level"]) == (4, 4, "INFO")
    (first,) = _launches(dp_reference / "job")
    assert sorted((e["how"], e["rank"]) for e in first) == [("warm", str(r)) for r in range(4)]
    assert [e["event"] for e in log][-1] == "standby_stopped"


@pytest.mark.timeout(900)  # the session's recovery bench, if no test has made it yet
def test_a_killed_rank_is_relaunched_warm_and_resumes_bit_identical(recovery_bench, dp_reference):
    out = recovery_bench.runs / "rank-kill"
    assert [d["action"] for d in decisions(out / "job")] == ["relaunch", "done"]
    first, again = _launches(out / "job")
    assert [e["how"] for e in first + again] == ["warm"] * 8
    assert not {e["pid"] for e in first} & {e["pid"] for e in again}, "a fresh child for every launch"
    recs = timeline.read(out)
    ran = {r["pid"] for r in recs if r["what"] == "start" and r["run"] == "0.1"}
    assert ran == {e["pid"] for e in again}, "the relaunched ranks are the standbys' children"
    assert recovery_bench.report["phases"]["rank_kill"]["warm_ranks"] == 4
    log = events.read(out / "job")
    kept = [e for e in log if e["event"] == "agents_kept"]
    assert len(kept) == 1 and kept[0]["cause"] == "task_failed", "the agents ran on through the relaunch"
    assert [e["event"] for e in log].count("agents_launch") == 1, "no agents' step was stopped or started for it"
    protected = [e["step"] for e in log if e["event"] == "snapshot_protected" and e["time"] > kept[0]["time"]]
    assert protected and max(protected) > FAULT_AT + 1, "and protected what the relaunched trainers snapshot"
    assert recovery_bench.report["rank_kill_warm_ranks"] == 4
    assert set(resumed_from(out).values()) == {min(resumed_from(out).values())} and \
        min(resumed_from(out).values()) >= FAULT_AT
    assert_same_result(out, dp_reference)


@pytest.mark.timeout(900)
def test_the_spare_taking_a_crashed_nodes_slot_starts_its_rank_warm(recovery_bench, dp_reference):
    out = recovery_bench.runs / "node-crash"
    assert [d["action"] for d in decisions(out / "job")] == ["replace", "done"]
    _, again = _launches(out / "job")
    assert sorted((e["node"], e["how"]) for e in again) == [("n1", "warm"), ("n2", "warm"), ("n4", "warm"),
                                                            ("n5", "warm")]
    log = events.read(out / "job")
    assert not [e for e in log if e["event"] == "standby_failed" and e.get("cause") != "step_ended"]
    relaunch = log[[i for i, e in enumerate(log) if e["event"] == "agents_launch"][1]:]
    agents = [(e["node"], e["how"]) for e in relaunch if e["event"] == "agent_start"]
    assert sorted(agents) == [("n1", "warm"), ("n2", "warm"), ("n4", "warm"), ("n5", "warm")], \
        "the relaunch's agents are forked too, the spare's included"
    assert_same_result(out, dp_reference)


@pytest.mark.timeout(900)
def test_the_spares_standby_calibrated_before_the_crash_and_the_lost_nodes_steps_stop_together(recovery_bench):
    """Off the recovery's critical path: every standby, the spare's too, resolved its node's copy method before it
    served (not the spare's first Checkpointer after the crash; "override": HPCFT_COPY set, as the suite does);
    after the node loss the trainers' and the agents' steps were stopped in one lost-node grace, not one after the
    other."""
    out = recovery_bench.runs / "node-crash"
    log = events.read(out / "job")
    ready = {e["node"]: e for e in log if e["event"] == "standby_ready"}
    assert sorted(ready) == [f"n{i}" for i in range(1, 7)]
    assert all(e["copy_method"] in ("measured", "cache", "override") and e["calibrate_s"] >= 0 for e in ready.values()), ready
    decided = next(e["time"] for e in log if e["event"] == "decision" and e["action"] == "replace")
    assert ready["n5"]["time"] < decided, "the spare's standby was ready (calibrated) before the crash"
    killed = [e for e in log if e["event"] == "step_killed" and e["time"] <= decided + 5]
    assert len(killed) == 1 and set(killed[0]["steps"].split(",")) == {"hpcft-train", "hpcft-agent"}, killed
    stopped = next(e for e in log if e["event"] == "agents_stopped" and e["time"] >= decided)
    assert stopped["how"] == "killed", stopped
