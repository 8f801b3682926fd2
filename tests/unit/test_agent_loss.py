"""The agents as the job's failure detector: the all-gather that opens every protection round fails on every
survivor when a peer dies, naming the lost peer's slot; the supervisor's side (`AgentSteps.lost`) turns failed
reports into the nodes to probe: the named ones, else every slot. Real sockets and real status files."""
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from hpcft.agent import status as agent_status
from hpcft.agent.mesh import Mesh
from hpcft.agent.transport import TransportError
from hpcft.launch.agents import AgentSteps
from hpcft.launch.config import RunConfig
from hpcft.launch.layout import Layout

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


def _steps(tmp_path: Path, proc: subprocess.Popen, tag: str = "3") -> AgentSteps:
    steps = AgentSteps(RunConfig(), runner=None, job_dir=tmp_path, python=sys.executable, emit=lambda *a, **k: None,
                       stop_steps=lambda procs: None, interrupted=lambda: False, check_nodes=lambda layout, probe: {})
    steps.prepare()
    steps.proc, steps.tag = proc, tag
    return steps


def test_failed_reports_name_the_nodes_to_probe(tmp_path):
    layout = Layout(slots=("frontier00041", "frontier00042", "frontier00043"), spares=())
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        steps = _steps(tmp_path, running)
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


def test_an_agents_step_that_ended_silently_is_a_loss_of_every_slot(tmp_path):
    layout = Layout(slots=("n1", "n2"), spares=())
    ended = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    ended.wait()
    steps = _steps(tmp_path, ended)
    suspects = steps.lost(layout)
    assert set(suspects) == {"n1", "n2"} and "exit status 3" in suspects["n1"]
    steps.proc = None  # no agents (--protect none and no durable tier): nothing to watch
    assert steps.lost(layout) is None
