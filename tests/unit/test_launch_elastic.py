"""Elastic shrink as plain data: the policy's shrink decision and its floor (--min-nodes), which survivor hosts a lost
slot's agent, the configuration of the smaller job, bad options, and the trainers' batch arithmetic (no Slurm)."""
import json

import pytest

from hpcft.elastic import KEEP_GLOBAL, KEEP_PER_RANK, BatchPlan, batch_plan
from hpcft.errors import ConfigError
from hpcft.launch.config import model as config
from hpcft.launch.config import resolve
from hpcft.launch.reshape import hosts, shrunk_config, trainer_env
from hpcft.launch.policy.layout import Layout
from hpcft.launch.policy.failures import EXIT_REQUEUED, Action, Event, Kind, State, decide, record

NOW = 1_000_000.0
FOUR = Layout(slots=("n1", "n2", "n3", "n4"), tasks_per_node=2)


def state(**kw) -> State:
    return State(**{"layout": FOUR, "end_time": NOW + 3600, "min_nodes": 3, **kw})


def test_no_spare_left_shrinks_onto_the_survivors_in_slot_order(tmp_path):
    event = Event(Kind.NODE_FAILED, bad_nodes=("n2",))
    d = decide(event, state(), NOW)
    assert d.action is Action.SHRINK and d.exit_code is None
    assert d.layout.slots == ("n1", "n3", "n4") and d.layout.excluded == ("n2",) and d.layout.world_size == 6
    rec = record(d, event, state(), str(tmp_path))
    assert (rec["action"], rec["cause"], rec["nodes_from"], rec["nodes_to"]) == ("shrink", "node_failed", 4, 3)


def test_below_min_nodes_or_without_elastic_it_requeues_as_before():
    two = Event(Kind.NODE_FAILED, bad_nodes=("n2", "n3"))
    d = decide(two, state(), NOW)
    assert (d.action, d.exit_code) == (Action.REQUEUE, EXIT_REQUEUED) and "fewer than --min-nodes 3" in d.reason
    assert d.layout.slots == FOUR.slots and d.layout.excluded == ("n2", "n3")
    assert decide(Event(Kind.NODE_FAILED, bad_nodes=("n2",)), state(min_nodes=None), NOW).action is Action.REQUEUE


def test_a_spare_is_still_preferred_and_the_walltime_margin_still_requeues():
    spare = Layout(slots=("n1", "n2"), spares=("n3",))
    assert decide(Event(Kind.NODE_FAILED, bad_nodes=("n2",)), state(layout=spare, min_nodes=1), NOW).action \
        is Action.REPLACE
    late = decide(Event(Kind.NODE_FAILED, bad_nodes=("n2",)), state(end_time=NOW + 10), NOW)
    assert late.action is Action.REQUEUE


def test_a_lost_slot_is_hosted_by_the_next_survivor_and_two_by_different_ones():
    assert hosts(FOUR, ["n2"]) == {1: "n3"}
    assert hosts(FOUR, ["n4"]) == {3: "n1"}  # wraps round
    assert hosts(FOUR, ["n1"]) == {0: "n2"}  # the first node lost: the second hosts it
    assert hosts(FOUR, ["n2", "n3"]) == {1: "n4", 2: "n1"}


def test_the_smaller_job_protects_with_sets_it_can_form():
    cfg = config.make(nodes=4, protect="xor", group=4, elastic=True)
    assert (shrunk_config(cfg, 3).launch.nodes, shrunk_config(cfg, 3).protection.group) == (3, 3)
    assert shrunk_config(cfg, 1).protection.protect == "none"
    rs = config.make(protect="rs", group=4, losses=2, elastic=True)
    assert (shrunk_config(rs, 2).protection.group, shrunk_config(rs, 2).protection.losses) == (2, 1)
    partner = config.make(protect="partner", distance=2, elastic=True)
    assert shrunk_config(partner, 2).protection.distance == 1
    assert trainer_env(cfg, 8) == {"HPCFT_ELASTIC_BATCH": KEEP_GLOBAL, "HPCFT_BASE_WORLD": "8"}
    assert trainer_env(config.make(), 8) == {}
    resolve.check_shape(config.make(elastic=True, min_nodes=4), 4)
    with pytest.raises(ConfigError, match="--min-nodes 5 is more than the 4 active"):
        resolve.check_shape(config.make(elastic=True, min_nodes=5), 4)  # --nodes not given: the allocation's


@pytest.mark.parametrize("cli, words", [
    ({"nodes": 2, "min_nodes": 3, "elastic": True}, "min_nodes 3 is more than nodes 2"),
    ({"elastic": True, "protect": "none"}, "elastic needs protection"),
    ({"elastic": True, "persist_dir": "none"}, "elastic needs a durable tier"),
    ({"min_nodes": 2}, "without elastic"),
    ({"elastic": True, "min_nodes": 0}, "min_nodes must be at least 1"),
    ({"elastic_grow": True}, "elastic_grow is given without elastic"),
    ({"elastic": True, "elastic_grow": True, "grow_settle": -1}, "grow_settle must be 0 or more"),
])
def test_bad_elastic_options_say_what_to_change(cli, words):
    with pytest.raises(ConfigError, match=words):
        config.load(cli, environ={})


def test_elastic_options_come_from_the_cli_the_environment_or_a_file():
    cfg = config.load({"elastic": True}, environ={"HPCFT_MIN_NODES": "2", "HPCFT_ELASTIC_BATCH": "keep-per-rank"})
    assert (cfg.elastic.elastic, cfg.elastic.min_nodes, cfg.elastic.elastic_batch) == (True, 2, KEEP_PER_RANK)
    with pytest.raises(ConfigError, match="is not one of keep-global, keep-per-rank"):
        config.load({"elastic": True, "elastic_batch": "keep-both"}, environ={})


class Ctx:
    def __init__(self, world, dp, dp_rank):
        self.world, self.dp, self.dp_rank = world, dp, dp_rank


def test_keep_global_deals_the_starting_micro_batches_over_the_replicas_left():
    env = {"HPCFT_ELASTIC_BATCH": KEEP_GLOBAL, "HPCFT_BASE_WORLD": "8"}
    plans = [batch_plan(Ctx(6, 6, r), environ=env) for r in range(6)]
    assert {p.micro_batches for p in plans} == {8} and plans[0].accumulation == 2
    dealt = sorted(i for p in plans for i in p.mine())
    assert dealt == list(range(8))  # every micro-batch of the step once
    assert list(plans[1].mine()) == [1, 7] and list(plans[5].mine()) == [5]


def test_keep_per_rank_shrinks_the_global_batch_and_no_env_is_the_starting_shape():
    env = {"HPCFT_ELASTIC_BATCH": KEEP_PER_RANK, "HPCFT_BASE_WORLD": "8"}
    plan = batch_plan(Ctx(6, 6, 2), per_replica=2, environ=env)
    assert (plan.micro_batches, list(plan.mine()), plan.accumulation) == (12, [2, 8], 2)
    assert batch_plan(Ctx(8, 4, 1), environ={}) == BatchPlan(KEEP_GLOBAL, 4, 4, 1)
    assert batch_plan(Ctx(6, 3, 0), environ={"HPCFT_BASE_WORLD": "8"}).base_replicas == 4  # tp=2
    with pytest.raises(ConfigError, match="not a multiple"):
        batch_plan(Ctx(6, 3, 0), environ={"HPCFT_BASE_WORLD": "7"})


class Recorder:
    """A narrow stand-in for the Runner: records the argv of each step started, starts nothing."""

    def __init__(self):
        self.started: list[list[str]] = []

    def popen(self, argv, **_):
        self.started.append(list(argv))
        return None


def test_a_shrinks_agents_run_on_the_survivors_with_the_lost_slot_hosted(tmp_path):
    from hpcft.launch.steps.agents import AgentSteps

    runner = Recorder()
    cfg = config.make(protect="xor", group=4, elastic=True)
    steps = AgentSteps(lambda: cfg, runner, tmp_path, "python", emit=lambda *a, **k: None, stop_steps=lambda s, **kw: None,
                       interrupted=lambda: False, check_nodes=lambda layout, probe: {})
    steps.rendezvous.mkdir()
    steps.tag = "0-shrink"
    steps._launch(FOUR, True, {}, {2: "n4"})
    hosted, main = runner.started

    def opt(argv, name):
        return next(a.split("=", 1)[1] for a in argv if a.startswith(name + "="))

    settings = main[main.index("--settings") + 1]
    assert opt(main, "--nodelist") == "n[1-2,4]"
    assert json.loads(settings)["layout"] == list(FOUR.slots)
    assert "--hosted" not in main and "--rebuild" in main
    assert (opt(hosted, "--job-name"), opt(hosted, "--nodelist")) == ("hpcft-agent-hosted-2", "n4")
    assert hosted[-5:] == ["--slot", "2", "--slots", "4", "--hosted"] and "--rebuild" in hosted
    assert hosted[hosted.index("--settings") + 1] == settings  # the same settings: the whole layout
