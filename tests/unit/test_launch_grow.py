"""Growing back as plain data (`hpcft run --elastic --elastic-grow`): when a returned node is taken back (settled, not
flapping, not too often, not at the walltime's end), to how many nodes, and the policy's grow decision (no Slurm)."""
from hpcft.launch.policy.layout import Layout
from hpcft.launch.policy.failures import Action, Event, Kind, State, decide, record
from hpcft.launch.policy.grow import GrowRules, Seen, choose, lost, observe, settle_for, unsettled

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


class Slurm:
    """A narrow stand-in for the Runner: scontrol's answers for one 4-node job, the node states as the test sets."""

    def __init__(self):
        self.states = {"n1": "MIXED", "n2": "MIXED", "n3": "DOWN+DRAIN", "n4": "MIXED"}

    def run(self, argv, **_):
        import subprocess

        if argv[:3] == ["scontrol", "show", "job"]:
            out = "JobId=7 NodeList=n[1-4] TimeLimit=UNLIMITED EndTime=Unknown BatchFlag=1 Requeue=1 Restarts=0"
        else:
            out = "\n".join(f"NodeName={n} State={self.states[n]}" for n in argv[-1].split(","))
        return subprocess.CompletedProcess(argv, 0, out, "")


class Probe:
    def __init__(self):
        self.failing: set[str] = set()

    def probe(self, nodes):
        return {n: "probe did not answer" for n in nodes if n in self.failing}


def test_the_watch_says_each_return_relapse_and_failed_probe_and_grows_only_past_them():
    from hpcft.launch.config import model as config
    from hpcft.launch.watch.grow import GrowWatch

    said, now = [], [T0]
    slurm, probe = Slurm(), Probe()
    cfg = config.make(elastic=True, elastic_grow=True, grow_settle=10, grow_every=50, poll_interval=1,
                      slurm_check_every=5)
    watch = GrowWatch(cfg, slurm, "7", probe, lambda kind, **f: said.append((kind, f)), clock=lambda: now[0])
    watch.target = 4
    shrunk = Layout(slots=("n1", "n2", "n4"), excluded=("n3",), tasks_per_node=2)
    watch.lost(["n3"])
    watch.reshaped()

    def at(t):
        now[0] = T0 + t
        return watch.poll(shrunk)

    assert at(1) is None and said == []  # still down
    slurm.states["n3"] = "MIXED"
    assert at(10) is None and [k for k, _ in said] == ["node_back"] and said[0][1]["settle"] == 10
    slurm.states["n3"] = "DOWN"
    assert at(15) is None and said[-1][0] == "node_relapse" and said[-1][1]["losses"] == 2
    slurm.states["n3"] = "MIXED"
    assert at(20) is None and said[-1][1]["settle"] == 20  # back again: twice the settle time
    assert at(40) is None and said[-1][0] == "grow_deferred" and said[-1][1]["blocked"] == "grow_every"
    count = len(said)
    assert at(45) is None and len(said) == count  # said once
    probe.failing = {"n3"}
    assert at(51) is None and [k for k, _ in said[count:]] == ["node_unsettled"]  # settled, probed: dead after all
    probe.failing = set()
    assert at(56) is None and said[-1][0] == "node_back" and said[-1][1]["losses"] == 2  # no loss counted
    assert at(71) is None  # 15 s of its 20
    event = at(76)
    assert event.kind is Kind.NODES_RETURNED and event.returned == ("n3",)
    assert watch.poll(Layout(slots=("n1", "n2", "n3", "n4"))) is None  # whole again: nothing to look at


def test_the_watch_never_takes_back_a_node_lost_past_max_losses_and_says_so_once():
    from hpcft.launch.config import model as config
    from hpcft.launch.watch.grow import GrowWatch

    said, now = [], [T0]
    slurm = Slurm()
    slurm.states["n3"] = "MIXED"
    cfg = config.make(elastic=True, elastic_grow=True, grow_settle=1, grow_every=0, grow_max_losses=1,
                           poll_interval=1)
    watch = GrowWatch(cfg, slurm, "7", Probe(), lambda kind, **f: said.append(kind), clock=lambda: now[0])
    watch.target = 4
    watch.lost(["n3"])
    watch.lost(["n3"])  # lost twice
    for t in (10, 20, 30):
        now[0] = T0 + t
        assert watch.poll(Layout(slots=("n1", "n2", "n4"))) is None
    assert said == ["node_retired"]


class Agents:
    """A narrow stand-in for AgentSteps: what the requeue's persist reports, and whether the agents were stopped."""

    def __init__(self, persisted):
        self.persisted, self.stopped = persisted, False

    def persist(self, bad_nodes=()):
        return self.persisted

    def stop(self, ask=True, flush=True):
        self.stopped = True


class Janitor:
    def __init__(self):
        self.wiped: list[list[str]] = []

    def wipe(self, nodes, env):
        self.wiped.append(list(nodes))
        return 0


def _grow(tmp_path, persisted):
    from hpcft.launch.config import model as config
    from hpcft.launch.reshape import Reshaper

    said, agents, janitor = [], Agents(persisted), Janitor()
    shrunk = Layout(slots=("n1", "n2", "n4"), excluded=("n3",), tasks_per_node=2)
    event = Event(Kind.NODES_RETURNED, returned=("n3",), detail="healthy")
    state = State(layout=shrunk, min_nodes=3)
    reshaper = Reshaper(config.make(elastic=True), agents, janitor, lambda kind, **f: said.append((kind, f)))
    done, line = reshaper.carry_out(decide(event, state, T0), event, state, {}, "t", str(tmp_path))
    return done, line, said[-1], agents, janitor


def test_a_grow_flushes_stops_and_wipes_every_node_of_the_larger_job(tmp_path):
    done, line, (kind, grow), agents, janitor = _grow(tmp_path, (8, 8, None))
    assert done.action is Action.GROW and done.layout.slots == ("n1", "n2", "n4", "n3")
    assert agents.stopped and janitor.wiped == [["n1", "n2", "n4", "n3"]]
    assert kind == "grow" and grow["ok"] and (grow["step"], grow["returned"], grow["source"]) == (8, "n3", "durable")
    assert line == "back on 4 nodes (n3 returned) from step 8, resharded from the durable tier"


def test_a_grow_that_cannot_flush_relaunches_on_the_same_nodes_from_their_memory(tmp_path):
    done, line, (kind, grow), agents, janitor = _grow(tmp_path, (8, 5, "the flush did not finish"))
    assert done.action is Action.RELAUNCH and done.layout.slots == ("n1", "n2", "n4") and "the grow failed" in done.reason
    assert agents.stopped and janitor.wiped == []  # nothing wiped: memory holds step 8
    assert kind == "grow" and not grow["ok"] and grow["error"] == "the flush did not finish"
    assert line.startswith("grow to 4 nodes failed")
    _, _, (_, stale), _, janitor = _grow(tmp_path, (8, 5, None))  # flushed, but an older step: not good enough
    assert not stale["ok"] and "durable step 5 is not the protected one 8" in stale["error"] and janitor.wiped == []
