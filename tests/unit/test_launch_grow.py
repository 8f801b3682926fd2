"""Growing back as plain data (`hpcft run --elastic --elastic-grow`): when a returned node is taken back (settled, not
flapping, not too often, not at the walltime's end), to how many nodes, and the policy's grow decision (no Slurm)."""
from hpcft.launch.layout import Layout
from hpcft.launch.policy import Action, Event, Kind, State, decide, record
from hpcft.launch.policy_grow import GrowRules, Seen, choose, lost, observe, settle_for, unsettled

RULES = GrowRules(target=4, settle=60, every=300, max_losses=2, margin=300)
T0 = 1_000_000.0  # the shrink


def look(seen, healthy, at):
    return observe(seen, healthy, at)[0]


def test_a_returned_node_is_taken_back_once_it_stayed_healthy_for_its_settle_time():
    seen = lost({}, ["n3"])  # the shrink lost it
    seen = look(seen, {"n3": True}, T0 + 250)
    assert choose(3, seen, RULES, T0 + 300, T0, None).nodes == ()  # healthy 50 s < 60
    got = choose(3, seen, RULES, T0 + 310, T0, None)
    assert got.nodes == ("n3",) and "n3 for 60 s" in got.why and "4 of 4" in got.why


def test_a_flapping_node_waits_twice_as_long_each_time_and_is_retired_past_max_losses():
    seen = look(lost({}, ["n3"]), {"n3": True}, T0 + 10)
    seen, relapsed = observe(seen, {"n3": False}, T0 + 40)  # down again while it settled
    assert relapsed == ["n3"] and seen["n3"] == Seen(None, 2)
    seen = look(seen, {"n3": True}, T0 + 400)
    assert settle_for(RULES, 2) == 120
    assert choose(3, seen, RULES, T0 + 500, T0, None).nodes == ()
    assert choose(3, seen, RULES, T0 + 520, T0, None).nodes == ("n3",)
    seen = look(observe(seen, {"n3": False}, T0 + 530)[0], {"n3": True}, T0 + 540)  # a third loss: retired
    assert seen["n3"].losses == 3 and choose(3, seen, RULES, T0 + 10_000, T0, None).nodes == ()


def test_a_failed_probe_restarts_the_settle_time_without_a_loss():
    """Slurm reads a dead node as healthy until its SlurmdTimeout: that lag must not retire it."""
    seen = look(lost({}, ["n3"]), {"n3": True}, T0 + 1)
    seen = unsettled(seen, ["n3"])
    assert seen["n3"] == Seen(None, 1)
    seen = look(seen, {"n3": True}, T0 + 400)
    assert choose(3, seen, RULES, T0 + 430, T0, None).nodes == () and choose(3, seen, RULES, T0 + 460, T0, None).nodes


def test_the_job_changes_shape_at_most_once_per_grow_every_and_not_near_its_walltime_end():
    seen = look(lost({}, ["n3"]), {"n3": True}, T0)
    early = choose(3, seen, RULES, T0 + 100, T0, None)
    assert early.nodes == () and early.blocked == "grow_every" and "--grow-every 300" in early.why
    late = choose(3, seen, RULES, T0 + 400, T0, time_left=200)
    assert late.nodes == () and late.blocked == "walltime"
    assert choose(3, seen, RULES, T0 + 400, T0, time_left=1000).nodes == ("n3",)


def test_it_grows_toward_the_starting_size_with_the_settled_nodes_in_allocation_order():
    seen = look(lost({}, ["n2", "n3", "n4"]), {"n2": True, "n3": True, "n4": False}, T0)
    assert choose(1, seen, RULES, T0 + 400, T0, None).nodes == ("n2", "n3")  # n4 is not back
    assert choose(2, seen, RULES, T0 + 400, T0, None).nodes == ("n2", "n3")
    assert choose(3, seen, RULES, T0 + 400, T0, None).nodes == ("n2",)  # one more reaches the 4 it started with
    assert choose(4, seen, RULES, T0 + 400, T0, None).nodes == ()


def test_the_grow_decision_takes_the_nodes_back_as_new_slots_and_is_no_restart(tmp_path):
    shrunk = Layout(slots=("n1", "n2", "n4"), excluded=("n3",), tasks_per_node=2)
    event = Event(Kind.NODES_RETURNED, returned=("n3",), detail="healthy n3 for 60 s")
    state = State(layout=shrunk, restarts=3, max_restarts=3, min_nodes=3)  # the failure budget is spent
    d = decide(event, state, T0)
    assert d.action is Action.GROW and d.exit_code is None and "n3 back in service" in d.reason
    assert (d.layout.slots, d.layout.excluded, d.layout.world_size) == (("n1", "n2", "n4", "n3"), (), 8)
    rec = record(d, event, state, str(tmp_path))
    assert (rec["action"], rec["cause"], rec["nodes_from"], rec["nodes_to"]) == ("grow", "nodes_returned", 3, 4)
