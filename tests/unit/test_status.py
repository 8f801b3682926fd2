"""`hpcft status` over agent status files written here: versions and their state, heartbeats, set health."""
import json
import time

from click.testing import CliRunner

from hpcft.agent import status as agent_status
from hpcft.cli import cli
from hpcft.status import AT_RISK, BEHIND, DEGRADED, HEALTHY, PROTECTED, STAGED, STOPPED, collect, render


def _agents(where, slots, scheme="xor", group=4, losses=1, silent=(), failed=(), absent=(), records=(3, 4), stopped=()):
    for s in range(slots):
        if s in absent:
            continue
        phase = "failed" if s in failed else "stopped" if s in stopped else "protecting"
        agent_status.write(where, "0", s, node=f"n{s}", phase=phase,
                           scheme=scheme, group=group, losses=losses, distance=1, slots=slots, interval=1.0,
                           staged=5, protected=max(records), persisted=None, local=4 if s == 0 else None, versions={"0": [3, 4, 5], "1": [4, 5]},
                           protected_steps=list(records), error="boom" if s in failed else None,
                           lag_steps=5 - max(records), lag_s=2.5)
    if silent:  # heartbeats from long ago
        for s in silent:
            path = agent_status.path(where, "0", s)
            st = json.loads(path.read_text())
            st["time"] = time.time() - 3600
            path.write_text(json.dumps(st))


def test_versions_states_and_a_degraded_set(tmp_path):
    _agents(tmp_path, 8, silent=(5,))
    view = collect(tmp_path)
    n0 = view.nodes[0]
    assert n0.fresh and n0.steps == {"3": PROTECTED, "4": PROTECTED, "5": STAGED}
    assert n0.ranks == {"0": [3, 4, 5], "1": [4, 5]}
    assert not view.nodes[5].fresh
    assert [(s.members, s.health, s.missing, s.protected_step) for s in view.sets] == [
        ([0, 1, 2, 3], HEALTHY, [], 4), ([4, 5, 6, 7], DEGRADED, [5], 4)]
    assert "silent" in view.sets[1].detail and "set 1 slots 4,5,6,7: degraded" in render(view)
    assert (n0.lag_steps, n0.lag_s) == (1, 2.5) and "1 (2.5 s)" in render(view)
    assert n0.local == 4 and view.nodes[1].local is None and "nvme" in render(view).splitlines()[1]


def test_two_losses_in_an_xor_set_or_a_partner_pair_are_at_risk_and_stopped_agents_are_not_losses(tmp_path):
    (tmp_path / "x").mkdir()
    _agents(tmp_path / "x", 4, failed=(1,), absent=(2,))
    view = collect(tmp_path / "x")
    assert view.sets[0].health == AT_RISK and view.sets[0].missing == [1, 2]
    assert "if only their agents died, their data is still in memory" in view.sets[0].detail
    assert "agent failed (boom)" in view.sets[0].detail and "no agent status" in view.sets[0].detail
    (tmp_path / "p").mkdir()
    _agents(tmp_path / "p", 4, scheme="partner", silent=(1,))
    assert collect(tmp_path / "p").sets[0].health == DEGRADED
    _agents(tmp_path / "p", 4, scheme="partner", silent=(1, 2))
    assert collect(tmp_path / "p").sets[0].health == AT_RISK
    (tmp_path / "s").mkdir()  # agents stopped at the end of a launch, an hour ago: their data stays in memory
    _agents(tmp_path / "s", 4, stopped=(0, 1, 2, 3), silent=(0, 1, 2, 3))
    assert [(s.health, s.missing) for s in collect(tmp_path / "s").sets] == [(STOPPED, [])]


def test_cli_json_and_a_clear_error_without_agents(tmp_path):
    (tmp_path / "agents").mkdir()  # `hpcft run`'s job dir holds the rendezvous as agents/
    _agents(tmp_path / "agents", 4)
    out = CliRunner().invoke(cli, ["status", str(tmp_path), "--json"])
    assert out.exit_code == 0, out.output
    got = json.loads(out.output)
    assert got["scheme"]["name"] == "xor" and [s["health"] for s in got["sets"]] == [HEALTHY]
    empty = tmp_path / "empty"
    empty.mkdir()
    out = CliRunner().invoke(cli, ["status", str(empty)])
    assert out.exit_code != 0 and "no agent reports" in str(out.exception or out.output)


def test_stragglers_named_by_the_supervisor_are_shown_until_cleared_and_an_evicted_one_stays_marked(tmp_path):
    from hpcft import events

    (tmp_path / "agents").mkdir()
    _agents(tmp_path / "agents", 4)
    for kind, fields in [("launch", {}), ("straggler", {"node": "n1", "ranks": "1", "ready_s": 0.6, "peers_s": 0.2,
                                                         "ratio": 3.0}),
                         ("straggler", {"node": "n2", "ranks": "2", "ready_s": 0.5, "peers_s": 0.2, "ratio": 2.5}),
                         ("straggler_cleared", {"node": "n2"}),
                         ("decision", {"action": "evict", "bad_nodes": "n1"}), ("launch", {})]:
        events.emit(kind, log_dir=tmp_path, **fields)
    view = collect(tmp_path)
    assert [(v.node, v.ranks, v.ratio, v.evicted) for v in view.stragglers] == [("n1", "1", 3.0, True)]
    assert "straggler n1 ranks 1: ready 0.600 s vs the peers' 0.200 s (3.00x), evicted onto a spare" in render(view)
    out = CliRunner().invoke(cli, ["status", str(tmp_path), "--json"])
    assert json.loads(out.output)["stragglers"][0]["node"] == "n1"


def _report(where, slot, tag="0", slots=4, age=1.0, **fields):
    st = {"node": f"n{slot}", "phase": "protecting", "scheme": "xor", "group": 4, "losses": 1, "distance": 1,
          "slots": slots, "interval": 1.0, "staged": 5, "protected": 4, "persisted": None,
          "versions": {str(slot): [4, 5]}, "protected_steps": [4], "lag_steps": 1, "lag_s": 1.0, **fields}
    agent_status.write(where, tag, slot, **st)
    path = agent_status.path(where, tag, slot)
    st = json.loads(path.read_text())
    st["time"] = time.time() - age
    path.write_text(json.dumps(st))


def test_a_protection_stall_is_a_warning_with_the_steps_at_risk_not_a_healthy_set(tmp_path):
    (tmp_path / "agents").mkdir()
    for s in range(4):  # protection stuck at 5 for a minute while the trainers reached 12
        _report(tmp_path / "agents", s, staged=12, protected=5, versions={str(s): [5, 11, 12]}, protected_steps=[4, 5],
                behind_since=time.time() - 60)
    (tmp_path / agent_status.LOG).write_text(json.dumps({"progress": {str(r): [12, 0.3, time.time()]
                                                                      for r in range(4)}}))
    view = collect(tmp_path)
    assert (view.training, view.steps_at_risk) == (12, 7)
    assert [s.health for s in view.sets] == [BEHIND] and view.warnings
    assert render(view).startswith("WARNING: protection trails the trainers by 7 steps")
    out = CliRunner().invoke(cli, ["status", str(tmp_path), "--json"])
    assert json.loads(out.output)["steps_at_risk"] == 7
    for s in range(4):  # protection that keeps up: 1 step at risk, healthy, no warning
        _report(tmp_path / "agents", s, staged=12, protected=11, versions={str(s): [11, 12]}, protected_steps=[10, 11],
                behind_since=time.time() - 0.5)
    view = collect(tmp_path)
    assert (view.steps_at_risk, [s.health for s in view.sets], view.warnings) == (1, [HEALTHY], [])
    for s in range(4):  # past the agents' lag bound: a warning however recent the last pass
        _report(tmp_path / "agents", s, staged=12, protected=8, versions={str(s): [8, 12]}, protected_steps=[8],
                behind_since=time.time() - 0.5, lag_bound=3)
    assert "over the agents' lag bound of 3" in collect(tmp_path).warnings[0]


def test_status_shows_only_the_newest_launch_and_records_of_steps_no_longer_held_protect_nothing(tmp_path):
    for s in range(4):  # launch 1 on 4 slots, stopped; launch 2 after an elastic shrink to 3
        _report(tmp_path, s, tag="1", age=30, phase="stopped", protected_steps=[16, 17], versions={str(s): [16, 17]})
    for s in range(3):
        _report(tmp_path, s, tag="2", slots=3, group=3, protected_steps=[17], versions={str(s): [17, 18]}, staged=18)
    view = collect(tmp_path)
    assert len(view.nodes) == 3 and [(s.health, s.protected_step) for s in view.sets] == [(HEALTHY, 17)]
    for s in range(3):  # a restart from 0: the old run's records of 10 and 11 stay, its trainers hold 5 and 6
        _report(tmp_path, s, tag="3", slots=3, group=3, staged=6, protected=11, protected_steps=[10, 11],
                versions={str(s): [5, 6]})
    view = collect(tmp_path)
    assert [s.protected_step for s in view.sets] == [None] and view.steps_at_risk == 6


def test_a_stopped_agent_is_not_marked_old_and_a_cleaned_job_says_its_memory_is_gone(tmp_path):
    from hpcft import events

    (tmp_path / "agents").mkdir()
    for s in range(4):
        _report(tmp_path / "agents", s, age=8, phase="stopped")
    table = render(collect(tmp_path))
    assert "8.0 s " in table and "8.0 s!" not in table
    assert "in their nodes' memory" in collect(tmp_path).sets[0].detail
    events.emit("cleaned", log_dir=tmp_path, nodes="n0,n1,n2,n3", exit_code=0, by="janitors")
    detail = collect(tmp_path).sets[0].detail
    assert "removed from the nodes' memory" in detail and "in their nodes' memory unless" not in detail
