"""The agents' CPU budget: what `hpcft run` tells them (cores per profile, the lag bound on by default, its ceiling),
where their step may run (the node's CPUs, unbound), the priority they yield to the trainers and take back while
the trainers wait on them, and a persist that never sleeps off a capped pass's debt."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from hpcft.agent.protection import budget
from hpcft.agent.protection.budget import LagBudget
from hpcft.agent.step import agent_argv
from hpcft.agent.transport import autogroup
from hpcft.agent.transport.throttle import Throttle
from hpcft.launch.config import model as config
from hpcft.launch.policy.layout import Layout
from hpcft.launch.steps.agentconf import agent_cores, agent_settings

NODES = ("n1", "n2", "n3")


@pytest.mark.parametrize("profile,cores", [("frontier", 1.0), ("cuda", 1.0), ("cpu", 0.01)])
def test_each_profile_states_a_budget_in_cores_and_the_option_wins(profile, cores):
    cfg = config.make(profile=profile, protect="xor")
    assert agent_cores(cfg) == cores
    settings = agent_settings(cfg, Path("/j"), Layout(slots=NODES), mpi=None)
    assert (settings.cpu_cores, settings.lag_bound) == (cores, budget.LAG_STEPS)  # the bound is on by default
    assert settings.lag_cores == max(1.0, 4 * cores)
    assert agent_cores(config.make(profile=profile, agent_cores=2.5)) == 2.5


def test_the_lag_bound_is_off_with_zero_and_its_ceiling_never_below_one_core():
    settings = agent_settings(config.make(protect="xor", protect_lag=0), Path("/j"), Layout(slots=NODES), mpi=None)
    assert settings.lag_bound is None
    assert budget.ceiling(0.01) == 1.0 and budget.ceiling(2.0) == 8.0


def test_a_bound_raises_the_cap_from_the_budget_to_the_ceiling_and_back():
    lag = LagBudget(floor=0.01, ceiling=budget.ceiling(0.01), bound=budget.LAG_STEPS)
    caps = []
    while lag.cap < 1.0:
        caps.append(lag.update(5)[0])
    assert caps[0] == 0.02 and len(caps) == 7  # doubling while over the bound, up to the ceiling
    unmet = [lag.update(5)[1] for _ in range(3)]
    assert unmet == [False, False, True]  # said once, after three rounds at the ceiling
    while lag.cap > 0.01:
        lag.update(0)
    assert lag.cap == 0.01  # back to the budget once well within the bound


def test_the_agent_meets_the_trainers_priority_only_while_they_wait_on_it():
    assert not budget.at_trainers_priority(over=False, persisting=False)
    assert budget.at_trainers_priority(over=True, persisting=False)
    assert budget.at_trainers_priority(over=False, persisting=True)


def test_the_agents_step_asks_for_the_nodes_cpus_unbound_when_they_are_known():
    settings = agent_settings(config.make(protect="xor"), Path("/j"), Layout(slots=NODES), mpi=None)
    argv = agent_argv(NODES, settings, python="python3", cpus=56)
    assert argv[argv.index("--cpus-per-task=56") + 1] == "--cpu-bind=none"
    assert "--overlap" in argv  # shared with the trainers' step, which holds the same cores
    assert not any(a.startswith("--cpu") for a in agent_argv(NODES, settings, python="python3"))


def test_a_release_wakes_a_take_sleeping_off_its_debt():
    """A persist drains the agents: a pass that owed 1 CPU-s at 0.01 cores would have slept 100 s of it."""
    cpu = [0.0]
    throttle = Throttle(None, cpu=0.01, cpu_clock=lambda: cpu[0])
    cpu[0] += 1.0
    started = time.monotonic()
    timer = threading.Timer(0.2, throttle.release)
    timer.start()
    throttle.take(1)
    assert time.monotonic() - started < 5.0
    timer.join()


class FakeAutogroup:
    """/proc/self/autogroup: reads `/autogroup-N nice K`; writing a number sets K."""

    def __init__(self):
        self.nice = 0

    def read_text(self) -> str:
        return f"/autogroup-7 nice {self.nice}\n"

    def write_text(self, text: str) -> None:
        self.nice = int(text)


def test_below_lowers_its_own_sessions_autogroup_and_gives_it_back(monkeypatch):
    path = FakeAutogroup()
    monkeypatch.setattr(autogroup, "own_session", lambda: True)
    monkeypatch.setattr(autogroup.os, "nice", lambda n: None)  # not this test process's own priority
    below = autogroup.Below(19, path)
    below.below()
    assert autogroup.current(path) == 19
    below.level()
    assert autogroup.current(path) == 0
    below.below()
    below.below()  # idempotent
    assert autogroup.current(path) == 19 and below.said()["autogroup_nice"] == 19


def test_below_leaves_a_session_it_does_not_lead_alone(monkeypatch):
    """A local agent shares its parent's session (a bench's trainer): lowering that would slow the trainer."""
    path = FakeAutogroup()
    monkeypatch.setattr(autogroup, "own_session", lambda: False)
    monkeypatch.setattr(autogroup.os, "nice", lambda n: None)
    below = autogroup.Below(19, path)
    below.below()
    assert autogroup.current(path) == 0 and below.said()["autogroup_nice"] is None


def test_hpcft_status_says_the_budget_once_and_the_cap_in_force():
    from hpcft.status import NodeView, _cpu_lines

    def node(slot: int, cap: float, nice: int | None) -> NodeView:
        return NodeView(slot, f"n{slot}", "protecting", 0.1, True, cpu_cores=cap, cpu_budget=1.0, cpu_ceiling=4.0,
                        cpu_set=56, autogroup_nice=nice)

    assert _cpu_lines([node(0, 1.0, 10), node(1, 1.0, 10)]) == [
        "agents' CPU: budget 1 cores each, up to 4 over the lag bound, over the 56 cores they may run on, below the "
        "trainers (autogroup nice 10)", "agents' CPU cap in force: 1 cores"]
    assert "at the trainers' priority now" in _cpu_lines([node(0, 2.0, 0)])[0]
    assert _cpu_lines([NodeView(0, None, "absent", None, False)]) == []


def test_an_srun_task_owns_its_steps_session_a_standbys_child_does_not(tmp_path, monkeypatch):
    """Each srun step's tasks share their slurmstepd's session (not theirs to lead), apart from the trainers' step."""
    monkeypatch.setattr(autogroup.os, "getsid", lambda _: 1)
    monkeypatch.setattr(autogroup.os, "getppid", lambda: 77)
    (tmp_path / "77").mkdir()
    for parent, owned in (("slurmstepd\n", True), ("python\n", False)):
        (tmp_path / "77" / "comm").write_text(parent)
        assert autogroup.own_session(tmp_path) is owned
    monkeypatch.setattr(autogroup.os, "getppid", lambda: 78)  # gone
    assert autogroup.own_session(tmp_path) is False
