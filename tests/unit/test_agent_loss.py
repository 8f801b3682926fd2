"""The agents as the job's failure detector: the all-gather that opens every protection round fails on every
survivor when a peer dies, naming the lost peer's slot; the supervisor's side (`AgentSteps.lost`) turns failed
reports into the nodes to probe: the named ones, else every slot. Real sockets and real status files."""
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import fake_probe  # tests/unit is on sys.path (pytest's rootdir insertion)

from hpcft.agent import status as agent_status
from hpcft.agent.transport.mesh import Mesh
from hpcft.agent.transport.tcp import TransportError
from hpcft.launch.steps.agents import AgentSteps
from hpcft.launch.config.model import RunConfig
from hpcft.launch.policy.layout import Layout
from hpcft.launch.node.nodecheck import NodeCheck
from hpcft.slurm.runner import Runner

SECRET = b"k" * 64


def _meshes(tmp_path: Path, size: int) -> list[Mesh]:
    made: list[Mesh | None] = [None] * size

    def join(slot: int) -> None:
        made[slot] = Mesh(slot, size, SECRET, tmp_path, host="127.0.0.1", bind="127.0.0.1", timeout=30, tag="t")

    threads = [threading.Thread(target=join, args=(s,)) for s in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(made), "every agent joined the mesh"
    return made


def _allgather(meshes: list[Mesh], values: list) -> list:
    """Every mesh's all-gather at once (a collective), each one's result or exception."""
    out: list = [None] * len(meshes)

    def one(m: Mesh) -> None:
        try:
            out[m.slot] = m.allgather(values[m.slot])
        except TransportError as exc:
            out[m.slot] = exc

    threads = [threading.Thread(target=one, args=(m,)) for m in meshes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_a_dead_peer_fails_the_next_all_gather_naming_its_slot(tmp_path):
    meshes = _meshes(tmp_path, 3)
    assert _allgather(meshes, [0, 10, 20]) == [[0, 10, 20]] * 3
    meshes[2].close()  # slot 2's agent dies: its sockets close, as a killed process's do
    survivors = _allgather(meshes[:2], ["next", "round"])
    try:
        assert all(isinstance(e, TransportError) and e.peer_slot == 2 for e in survivors), survivors
    finally:
        for m in meshes[:2]:
            m.close()


@pytest.fixture
def made_steps():
    """AgentSteps made by a test, closed after it (prepare serves the agents' directory: a thread and a socket)."""
    made: list[AgentSteps] = []
    yield made
    for steps in made:
        steps.close()


def _steps(tmp_path: Path, proc: subprocess.Popen, made: list, tag: str = "3") -> AgentSteps:
    steps = AgentSteps(RunConfig, runner=None, job_dir=tmp_path, python=sys.executable, emit=lambda *a, **k: None,
                       stop_steps=lambda procs, **kw: None, interrupted=lambda: False, check_nodes=lambda layout, probe: {})
    steps.prepare()
    steps.proc, steps.tag = proc, tag
    made.append(steps)
    return steps


def test_failed_reports_name_the_nodes_to_probe(tmp_path, made_steps):
    layout = Layout(slots=("frontier00041", "frontier00042", "frontier00043"), spares=())
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        steps = _steps(tmp_path, running, made_steps)
        for slot in range(3):
            agent_status.write(steps.rendezvous, "3", slot, phase=agent_status.PROTECTING)
        assert steps.lost(layout) is None  # all well
        agent_status.write(steps.rendezvous, "3", 0, phase=agent_status.FAILED, error="peer closed", peer_slot=2)
        agent_status.write(steps.rendezvous, "3", 1, phase=agent_status.FAILED, error="peer closed", peer_slot=0)
        suspects = steps.lost(layout)
        assert set(suspects) == {"frontier00043", "frontier00041"} and "slot 0 lost it" in suspects["frontier00043"]
        agent_status.write(steps.rendezvous, "3", 0, phase=agent_status.FAILED, error="bad manifest")
        agent_status.write(steps.rendezvous, "3", 1, phase=agent_status.PROTECTING)
        assert set(steps.lost(layout)) == set(layout.slots)  # nobody named: every slot is checked
    finally:
        running.kill()
        running.wait()


def test_an_agents_step_that_ended_silently_is_a_loss_of_every_slot(tmp_path, made_steps):
    layout = Layout(slots=("n1", "n2"), spares=())
    ended = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    ended.wait()
    steps = _steps(tmp_path, ended, made_steps)
    suspects = steps.lost(layout)
    assert set(suspects) == {"n1", "n2"} and "exit status 3" in suspects["n1"]
    steps.proc = None  # no agents (--protect none and no durable tier): nothing to watch
    assert steps.lost(layout) is None


class _Sleepers(Runner):
    """srun's stand-in for the agents' step: a process that sleeps (the test writes the agents' reports)."""

    def popen(self, argv, *, env=None, **kwargs):
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], **kwargs)


def test_agents_started_beside_the_trainers_are_ready_once_all_say_so_and_late_ones_are_named(tmp_path, made_steps):
    from hpcft.launch.config.model import make

    layout, said = Layout(slots=("frontier00041", "frontier00042"), spares=()), []
    steps = AgentSteps(lambda: make(protect_timeout=0.5, protect="xor"), runner=_Sleepers(), job_dir=tmp_path,
                       python=sys.executable, emit=lambda kind, **f: said.append((kind, f)),
                       stop_steps=lambda procs, **kw: [p.kill() or p.wait() for p in procs.values()],
                       interrupted=lambda: False, check_nodes=lambda layout, probe: {})
    made_steps.append(steps)
    steps.prepare()
    assert steps.gate(layout, 0), "the first launch waits for its agents: they announce their pins first"
    steps._ready_slots = layout.slots  # as once a launch's agents were ready on these slots
    assert not steps.gate(layout, 1) and steps.gate(Layout(slots=("frontier00041", "frontier00043")), 1)
    try:
        steps.beside(layout, 1, {})
        agent_status.write(steps.rendezvous, "1", 0, phase=agent_status.READY)
        assert steps.lost(layout) is None and not [k for k, _ in said if k == "agents_ready"]  # slot 1 not yet
        agent_status.write(steps.rendezvous, "1", 1, phase=agent_status.PROTECTING)
        assert steps.lost(layout) is None
        ready = [f for k, f in said if k == "agents_ready"]
        assert len(ready) == 1 and ready[0]["beside"] and ready[0]["tag"] == "1" and not ready[0]["rebuild"], said
        steps.stop(ask=False)
        steps.beside(layout, 2, {})  # the next relaunch's agents: one never reports
        agent_status.write(steps.rendezvous, "2", 1, phase=agent_status.READY)
        assert steps.lost(layout) is None  # within --protect-timeout
        time.sleep(0.6)
        late = steps.lost(layout)
        assert set(late) == {"frontier00041"} and "not ready within --protect-timeout 0.5 s" in late["frontier00041"]
    finally:
        steps.stop(ask=False)


class _Agents:
    """A narrow stand-in for AgentSteps: restarts that succeed or fail as told, and what was asked of it."""

    def __init__(self, outcomes: list):
        self.tag, self.bad_nodes, self.outcomes, self.calls = "0", {}, outcomes, []
        self.named: dict[str, str] = {}  # the peers failed agents named ({node: why}), as AgentSteps.lost says
        self.late_nodes: dict[str, str] = {}  # the peers running agents find late, as AgentSteps.late says
        self.cfg = RunConfig()  # the run's options, as AgentSteps has them (its transport)

    def lost(self, layout):
        return self.named or None

    def late(self, layout):
        return self.late_nodes

    def stop(self, ask: bool = True, flush: bool = True) -> None:
        self.calls.append(("stop", ask, flush))

    def start(self, layout, restart_count, env, *, tag=None):
        self.calls.append(("start", tag))
        self.tag = tag
        return self.outcomes.pop(0)


class _Nodes:
    def __init__(self, bad: dict):
        self.bad_ones, self.asked = bad, []

    def bad(self, nodes, *, probe, found_by=None, suspected=None, controls=(), ahead=None):
        self.asked.append((tuple(nodes), found_by, dict(suspected or {})))
        self.controls = tuple(controls)
        return {n: w for n, w in self.bad_ones.items() if n in nodes}


def test_agents_that_fail_on_healthy_nodes_restart_alone_and_a_failed_restart_relaunches():
    from hpcft.errors import CheckpointError
    from hpcft.launch.steps.agentloss import ALONE_PER_LAUNCH, AgentLoss
    from hpcft.launch.policy.failures import Kind

    layout = Layout(slots=("n1", "n2", "n3"), spares=())
    said: list = []
    agents = _Agents([None, CheckpointError("agent of slot 1 failed: boom")])
    loss = AgentLoss(agents, _Nodes({}), lambda kind, **f: said.append((kind, f)), interrupted=lambda: False)
    suspects = {"n3": "agent of slot 0 lost it: the agent of slot 2 was silent for 5.4 s (loss timeout 5 s)"}
    assert loss.while_training(layout, suspects, 0, {}) is None  # restarted alone: the trainers go on
    assert agents.calls == [("stop", False, False), ("start", "0-alone1")]
    assert [k for k, _ in said] == ["agents_suspect", "agents_failed", "agents_restart"]
    assert said[0][1]["nodes"] == "n3" and "silent" in said[0][1]["reason"]
    assert said[1][1]["level"] == logging.ERROR and "restart alone" in said[1][1]["action"]
    assert said[2][1]["ok"] is True and said[2][1]["trainers"] == "kept" and said[2][1]["replaced"] == "0"
    event = loss.while_training(layout, suspects, 0, {})  # the next restart fails: a relaunch from memory
    assert event.kind is Kind.AGENT_FAILED and "boom" in event.detail
    assert said[-1][0] == "agents_restart" and said[-1][1]["ok"] is False
    loss.alone = ALONE_PER_LAUNCH
    assert loss.while_training(layout, suspects, 0, {}).kind is Kind.AGENT_FAILED  # no endless restarts
    loss.launched()
    assert loss.alone == 0


def test_a_suspect_that_fails_the_probe_is_a_lost_node_and_the_agents_are_not_restarted():
    from hpcft.launch.steps.agentloss import AgentLoss
    from hpcft.launch.policy.failures import Kind

    layout = Layout(slots=("n1", "n2", "n3"), spares=())
    agents, nodes = _Agents([]), _Nodes({"n3": "probe did not answer within 5 s"})
    loss = AgentLoss(agents, nodes, lambda kind, **f: None, interrupted=lambda: False)
    suspects = {"n3": "agent of slot 0 lost it: the agent of slot 2 was silent for 5.4 s (loss timeout 5 s)"}
    event = loss.while_training(layout, suspects, 0, {})
    assert event.kind is Kind.NODE_FAILED and event.bad_nodes == ("n3",) and agents.calls == []
    assert nodes.asked == [(("n3",), "agents", suspects)]  # the named node only, with what the agents said


class _FrozenCluster(Runner):
    """Slurm answered with canned text (node n3 goes NOT_RESPONDING after `marks_after` s), probes as real processes:
    n3's never answers (a frozen slurmd), the others echo their name."""

    def __init__(self, marks_after: float):
        super().__init__()
        self.since = time.monotonic()
        self.marks_after = marks_after
        self.frozen = {"n3"}  # whose probe never answers

    def run(self, argv, **kw):
        if argv[:3] == ["scontrol", "show", "job"]:
            out = "JobId=7 NodeList=n[1-3] TimeLimit=UNLIMITED"
        else:
            late = time.monotonic() - self.since > self.marks_after
            out = "\n".join(f"NodeName={n} State={'IDLE+NOT_RESPONDING' if n == 'n3' and late else 'MIXED'}"
                            for n in ("n1", "n2", "n3"))
        return subprocess.CompletedProcess(argv, 0, out, "")

    def popen(self, argv, **kw):
        return fake_probe.probe(argv, self.frozen, stdout=kw.get("stdout"), stderr=kw.get("stderr"))


def test_a_probe_still_waiting_for_a_frozen_node_ends_when_slurm_marks_it():
    checks = NodeCheck(_FrozenCluster(marks_after=1.0), "7", {}, probe_timeout=600, emit=lambda *a, **k: None)
    bad = checks.probe(["n1", "n2", "n3"])
    assert set(bad) == {"n3"} and "NOT_RESPONDING (Slurm, while the probe waited)" in bad["n3"], bad


def test_a_late_node_is_probed_ahead_and_the_verdict_is_used_once_the_agents_name_it_lost():
    from hpcft.launch.steps.agentloss import AgentLoss
    from hpcft.launch.policy.failures import CONTROL_FLOOR_S

    layout, said = Layout(slots=("n1", "n2", "n3"), spares=()), []
    checks = NodeCheck(_FrozenCluster(marks_after=600), "7", {}, probe_timeout=600, emit=lambda *a, **k: None)
    agents = _Agents([])
    loss = AgentLoss(agents, checks, lambda kind, **f: said.append((kind, f)), interrupted=lambda: False)
    loss.ahead(layout)
    assert said == []  # nobody late
    agents.late_nodes = {"n3": "the agent of slot 0 has not heard its agent for over half the loss timeout (3 s)"}
    loss.ahead(layout)
    loss.ahead(layout)  # probed once
    assert [k for k, _ in said] == ["agents_late"] and said[0][1]["nodes"] == "n3"
    time.sleep(CONTROL_FLOOR_S + 0.5)  # the rest of the loss timeout: the verdict is in
    asked = time.monotonic()
    bad = loss.suspects_lost(layout, {"n3": "agent of slot 0 lost it: silent for 3.3 s"})
    assert set(bad) == {"n3"} and "(probed ahead)" in bad["n3"] and "did not answer" in bad["n3"], bad
    assert time.monotonic() - asked < CONTROL_FLOOR_S  # no new probe waited for
    checks.runner.frozen = {"n2", "n3"}  # two of a set at once: both late, both probed ahead, both in the verdict
    agents.late_nodes = {"n2": "late", "n3": "late"}
    loss.ahead(layout)
    time.sleep(CONTROL_FLOOR_S + 0.5)
    bad = loss.suspects_lost(layout, {"n3": "agent of slot 0 lost it: silent for 3.3 s"})  # the first one named
    assert set(bad) == {"n2", "n3"} and all("(probed ahead)" in w for w in bad.values()), bad
    checks.runner.frozen = {"n3"}
    loss.ahead(layout)
    agents.late_nodes = {}
    loss.ahead(layout)  # heard again: the verdict is dropped
    bad = loss.suspects_lost(layout, {"n3": "agent of slot 0 lost it: silent for 3.3 s"})  # nothing ahead: probed now
    assert set(bad) == {"n3"} and "(probed ahead)" not in bad["n3"]
    assert [k for k, _ in said] == ["agents_late"] * 3


def test_an_agents_step_that_ended_before_ready_on_healthy_nodes_is_launched_once_more_before_the_trainers():
    from hpcft.errors import CheckpointError
    from hpcft.launch.steps.agentloss import AgentLoss
    from hpcft.launch.steps.agents import StepEnded
    from hpcft.launch.policy.failures import Kind

    layout = Layout(slots=("frontier00041", "frontier00042"), spares=())
    ended = StepEnded("the agents' step ended (exit status 141) before every agent was ready", 141)
    said: list = []
    agents = _Agents([None])
    loss = AgentLoss(agents, _Nodes({}), lambda kind, **f: said.append((kind, f)), interrupted=lambda: False)
    assert loss.before_training(layout, ended, 0, {}) is None  # the second try is ready: the trainers start
    assert agents.calls == [("stop", False, False), ("start", "0-again")]
    assert said[0][0] == "agents_again" and said[0][1]["level"] == logging.WARNING and "141" in said[0][1]["reason"]

    agents = _Agents([StepEnded("the agents' step ended (exit status 1) before every agent was ready", 1)])
    loss = AgentLoss(agents, _Nodes({}), lambda kind, **f: None, interrupted=lambda: False)
    event = loss.before_training(layout, ended, 0, {})  # once only: the second failure is the launch's
    assert event.kind is Kind.AGENT_FAILED and "exit status 1" in event.detail and len(agents.calls) == 2

    agents = _Agents([])
    lost = AgentLoss(agents, _Nodes({"frontier00042": "probe did not answer within 15 s"}), lambda kind, **f: None,
                     interrupted=lambda: False).before_training(layout, ended, 0, {})
    assert lost.kind is Kind.NODE_FAILED and lost.bad_nodes == ("frontier00042",) and agents.calls == []
    failed = AgentLoss(agents, _Nodes({}), lambda kind, **f: None, interrupted=lambda: False).before_training(
        layout, CheckpointError("agent of slot 1 failed: bad manifest"), 0, {})  # an agent's own error: no retry
    assert failed.kind is Kind.AGENT_FAILED and agents.calls == []
    killed = AgentLoss(agents, _Nodes({}), lambda kind, **f: None, interrupted=lambda: False).before_training(
        layout, StepEnded("the agents' step ended (exit status -9)", -9), 0, {})  # srun killed: its agents may live on
    assert killed.kind is Kind.AGENT_FAILED and agents.calls == []


def test_a_peer_the_agents_named_before_they_were_ready_is_probed_beside_controls_as_while_training():
    """A node lost while the agents rebuild cost ~25 s: every slot was probed without controls (the frozen node
    answered at the probe timeout), then the agents' step was asked to stop for --kill-grace."""
    from hpcft.errors import CheckpointError
    from hpcft.launch.steps.agentloss import AgentLoss
    from hpcft.launch.policy.failures import Kind

    layout = Layout(slots=("frontier00041", "frontier00042", "frontier00043", "frontier00044"), spares=())
    agents = _Agents([])
    agents.named = {"frontier00043": "agent of slot 1 lost it: the agent of slot 2 was silent for 3.3 s"}
    nodes = _Nodes({"frontier00043": "probe did not answer within 1 s"})
    event = AgentLoss(agents, nodes, lambda kind, **f: None, interrupted=lambda: False).before_training(
        layout, CheckpointError("agent of slot 1 failed: the agent of slot 2 was silent for 3.3 s"), 0, {})
    assert event.kind is Kind.NODE_FAILED and event.bad_nodes == ("frontier00043",)
    assert nodes.asked == [(("frontier00043",), "agents", agents.named)]
    assert nodes.controls and "frontier00043" not in nodes.controls
