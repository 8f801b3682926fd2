"""The supervisor's policy as plain data in, decision out, with a fake clock (no Slurm)."""
import pytest

from hpcft import events
from hpcft.launch.policy.layout import Layout
from hpcft.slurm import state as slurm_state
from hpcft.launch.policy.failures import (EXIT_ERROR, EXIT_GAVE_UP, EXIT_NO_REQUEUE, EXIT_OK, EXIT_REQUEUED, Action, Event, Kind, State,
                                 decide, hung, record, stale_signal)

NOW = 1_000_000.0
LAYOUT = Layout.plan(["n1", "n2", "n3", "n4", "n5"], spares=1)


def state(**kw) -> State:
    return State(**{"layout": LAYOUT, "end_time": NOW + 3600, "requeue_margin": 300.0, **kw})


def test_success_is_done():
    d = decide(Event(Kind.SUCCESS, exit_code=0), state(), NOW)
    assert (d.action, d.exit_code) == (Action.DONE, EXIT_OK)


def test_process_failure_on_healthy_nodes_relaunches_in_place():
    d = decide(Event(Kind.TASK_FAILED, exit_code=9, failed_tasks=("n2: task 1: Killed",)), state(), NOW)
    assert d.action is Action.RELAUNCH and d.layout == LAYOUT


def test_hang_relaunches_in_place():
    assert decide(Event(Kind.HANG), state(), NOW).action is Action.RELAUNCH


def test_a_start_up_is_allowed_the_start_timeout_and_each_later_step_the_hang_timeout():
    launched = NOW - 100
    assert hung(NOW, launched, None, hang_timeout=0) is None  # off
    assert hung(NOW, launched, None, hang_timeout=10, start_timeout=120) is None  # still starting, within 120 s
    assert "100 s since the launch" in hung(NOW, launched, None, hang_timeout=10, start_timeout=90)
    assert "since the launch" in hung(NOW, launched, None, hang_timeout=10)  # no start timeout: the hang timeout
    assert hung(NOW, launched, None, hang_timeout=120) is None
    assert hung(NOW, launched, NOW - 9, hang_timeout=10, start_timeout=120) is None  # stepping
    assert hung(NOW, launched, NOW - 11, hang_timeout=10, start_timeout=120) == "no completed step for 11 s"


def test_agents_not_ready_on_healthy_nodes_relaunch_in_place_and_count_as_a_restart():
    assert decide(Event(Kind.AGENT_FAILED, detail="slot 2 failed"), state(), NOW).action is Action.RELAUNCH
    assert decide(Event(Kind.AGENT_FAILED), state(restarts=3), NOW).exit_code == EXIT_GAVE_UP


def test_failed_node_is_replaced_by_a_spare_in_its_slot():
    d = decide(Event(Kind.NODE_FAILED, bad_nodes=("n3",)), state(), NOW)
    assert d.action is Action.REPLACE and d.replaced == {"n3": "n5"}
    assert d.layout.slots == ("n1", "n2", "n5", "n4") and d.layout.excluded == ("n3",)


def test_a_closed_node_found_bad_takes_a_spare_while_one_is_left_else_keeps_its_slot():
    """A drained node (closed: it still runs the job) counted bad after a failure: a spare takes its slot if one
    is left once the lost nodes have theirs; without, it keeps its slot, no requeue, no shrink."""
    drained = Event.nodes_lost({"n3": "MIXED+DRAIN"}, closed=["n3"])
    assert drained.lost_nodes == () and drained.closed == ("n3",)
    d = decide(drained, state(), NOW)
    assert d.action is Action.REPLACE and d.replaced == {"n3": "n5"}
    used, _ = LAYOUT.replace(["n1"])  # no spare left
    for elastic in (None, 2):
        d = decide(drained, state(layout=used, min_nodes=elastic), NOW)
        assert d.action is Action.RELAUNCH and d.layout == used, d
        assert "closed node(s) n3 keep their slots" in d.reason and "no node lost" in d.reason, d.reason
    both = Event.nodes_lost({"n2": "probe failed", "n3": "MIXED+DRAIN"}, closed=["n3"])  # the one spare: the lost
    d = decide(both, state(), NOW)
    assert d.action is Action.REPLACE and d.replaced == {"n2": "n5"} and "n3" in d.layout.slots, d
    assert "closed node(s) n3 keep their slots" in d.reason, d.reason
    d = decide(both, state(layout=used), NOW)  # no spare: the lost node requeues, the drained one is not excluded
    assert d.action is Action.REQUEUE and "n2" in d.layout.excluded and "n3" not in d.layout.excluded, d


def test_no_spare_left_persists_and_requeues_with_the_node_excluded():
    used, _ = LAYOUT.replace(["n1"])
    d = decide(Event(Kind.NODE_FAILED, bad_nodes=("n2",)), state(layout=used), NOW)
    assert (d.action, d.exit_code) == (Action.REQUEUE, EXIT_REQUEUED)
    assert set(d.layout.excluded) == {"n1", "n2"}
    stopped = decide(Event(Kind.NODE_FAILED, bad_nodes=("n2",)), state(layout=used, requeue_allowed=False), NOW)
    assert (stopped.action, stopped.exit_code) == (Action.STOP, EXIT_NO_REQUEUE)


@pytest.mark.parametrize("left, action", [(301, Action.RELAUNCH), (299, Action.REQUEUE), (-5, Action.REQUEUE)])
def test_little_walltime_left_requeues_instead_of_relaunching(left, action):
    assert decide(Event(Kind.TASK_FAILED, exit_code=1), state(end_time=NOW + left), NOW).action is action


def test_no_time_limit_never_requeues_for_time():
    assert decide(Event(Kind.TASK_FAILED), state(end_time=None), NOW).action is Action.RELAUNCH


def test_near_the_end_without_requeue_it_still_relaunches():
    got = decide(Event(Kind.TASK_FAILED), state(end_time=NOW + 10, requeue_allowed=False), NOW)
    assert got.action is Action.RELAUNCH


def test_walltime_signal_and_lost_allocation_requeue():
    assert decide(Event(Kind.WALLTIME), state(), NOW).action is Action.REQUEUE
    assert decide(Event(Kind.ALLOCATION_LOST), state(), NOW).action is Action.REQUEUE
    assert decide(Event(Kind.WALLTIME), state(requeue_allowed=False), NOW).exit_code == EXIT_NO_REQUEUE


@pytest.mark.parametrize("requeued_run,progressed,time_left,stale", [
    (True, False, 3000.0, True),    # the previous run's signal, delivered late into the requeued run
    (True, False, None, True),      # unlimited walltime: never a walltime warning
    (True, False, 20.0, False),     # walltime really short: a genuine warning, even before the first step
    (True, True, 3000.0, False),    # the requeued run has made progress: a new request to requeue
    (False, False, 3000.0, False),  # a first run never receives a previous run's signal
])
def test_usr1_is_ignored_only_when_it_cannot_be_for_this_run(requeued_run, progressed, time_left, stale):
    why = stale_signal(requeued_run=requeued_run, progressed=progressed, time_left=time_left, margin=30.0)
    assert (why is not None) is stale
    if stale:
        assert "requeued run" in why and "--requeue-margin 30" in why


def test_stop_after_max_restarts_with_a_summary():
    d = decide(Event(Kind.TASK_FAILED, exit_code=1), state(restarts=3, max_restarts=3), NOW)
    assert (d.action, d.exit_code) == (Action.STOP, EXIT_GAVE_UP)
    assert "after 3 restart(s), the limit (--max-restarts 3)" in d.reason


def test_a_step_slurm_refuses_stops_at_once_with_slurms_words():
    lines = ["srun: error: Unable to create step for job 7: More processors requested than permitted"]
    detail = slurm_state.step_refusal(lines)
    assert detail == "More processors requested than permitted"
    d = decide(Event(Kind.STEP_REFUSED, exit_code=1, detail=detail), state(restarts=0), NOW)
    assert (d.action, d.exit_code) == (Action.STOP, EXIT_ERROR) and detail in d.reason
    # a refusal another try may not meet is a plain task failure (relaunched)
    assert slurm_state.step_refusal(["srun: error: Unable to create step for job 7: Required node not available "
                                     "(down, drained or reserved)"]) is None
    assert slurm_state.step_refusal(["srun: error: n2: task 1: Exited with exit code 3"]) is None


def test_every_decision_is_one_line_and_one_json_record(tmp_path, caplog):
    ev, st = Event(Kind.NODE_FAILED, bad_nodes=("n3",)), state(restarts=1)
    d = decide(ev, st, NOW)
    with caplog.at_level("INFO", logger="hpcft.events"):
        record(d, ev, st, str(tmp_path))
    assert any(r.getMessage().startswith("event=decision action=replace cause=node_failed ") for r in caplog.records)
    (rec,) = events.read(tmp_path)
    assert (rec["action"], rec["replaced"], rec["slots"], rec["restarts"]) == ("replace", "n3:n5", "n1,n2,n5,n4", 1)
