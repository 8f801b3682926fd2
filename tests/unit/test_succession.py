"""The supervisor's succession (launch/node/succession.py) and the janitors' watch of it (node/janitor.py): who watches,
the beacon over real UDP, the claim, the successor's environment, and when Slurm is asked."""
import dataclasses
import os
from pathlib import Path

import pytest

from hpcft.launch.node import succession
from hpcft.launch.node import janitor
from hpcft.launch.node.janitor import SupervisorWatch


def _record(tmp_path: Path, beacon: succession.Beacon | None = None, **fields) -> succession.Record:
    rec = succession.Record(generation=0, host="frontier00042", beacon=beacon.address if beacon else "127.0.0.1:9",
                            token=beacon.token if beacon else "t", argv=["run", "--", "python", "train.py"],
                            cwd=str(tmp_path), env={"SLURM_JOB_ID": "7", "PATH": "/usr/bin"}, **fields)
    rec.write(tmp_path)
    return rec


def test_the_watchers_are_the_nodes_after_the_supervisor_wrapping_round_and_never_its_own():
    nodes = [f"frontier{i:05d}" for i in range(40, 46)]
    assert succession.watchers(nodes, "frontier00044") == ["frontier00045", "frontier00040", "frontier00041"]
    assert succession.watchers(nodes, "frontier00045", k=2) == ["frontier00040", "frontier00041"]
    assert succession.watchers(nodes, "login1") == nodes[:3]  # salloc's hpcft run on a login node
    assert succession.watchers(["a"], "a") == []


def test_the_record_round_trips_and_only_its_owner_reads_it(tmp_path):
    rec = _record(tmp_path)
    assert succession.read(tmp_path) == rec
    assert oct(os.stat(succession.record_path(tmp_path)).st_mode & 0o777) == "0o600"  # it holds the environment
    succession.record_path(tmp_path).write_text("{not json")
    assert succession.read(tmp_path) is None
    assert succession.read(tmp_path / "nowhere") is None


def test_the_beacon_answers_its_token_only_and_a_closed_one_is_silent():
    beacon = succession.Beacon("secret", 3)
    try:
        assert succession.ping(beacon.address, "secret") == 3
        assert succession.ping(beacon.address, "guess", timeout=0.3) is None
    finally:
        beacon.close()
    assert succession.ping(beacon.address, "secret", timeout=0.3) is None


def test_one_janitor_claims_each_generation_of_each_slurm_run(tmp_path):
    assert succession.claim(tmp_path, "0", 1) is True
    assert succession.claim(tmp_path, "0", 1) is False
    assert succession.claim(tmp_path, "0", 2) is True
    assert succession.claim(tmp_path, "1", 1) is True  # a requeued run's own chain


def test_a_successor_runs_with_the_supervisors_environment_not_the_janitor_steps(tmp_path):
    rec = _record(tmp_path)
    env = succession.successor_env(rec, {"SLURM_STEP_ID": "3", "SLURMD_NODENAME": "frontier00043",
                                         "PYTHONPATH": "/opt/hpcft"}, 2)
    assert env == {"SLURM_JOB_ID": "7", "PATH": "/usr/bin", "SLURMD_NODENAME": "frontier00043",
                   "PYTHONPATH": "/opt/hpcft", succession.ENV_SUCCESSION: "2:frontier00042"}
    assert succession.succeeds(env) == (2, "frontier00042")
    assert succession.succeeds({}) == (0, "")
    assert succession.succeeds({succession.ENV_SUCCESSION: "x:y"}) == (0, "")


def _checks(bad: dict[str, str]):
    """A NodeCheck whose `bad` (Slurm's view, then a probe beside the asking node) finds `bad`."""
    class Check:
        def __init__(self, *args):
            pass

        def bad(self, nodes, **kwargs):
            assert kwargs["probe"] is True and kwargs["controls"], kwargs  # a probe, beside a control
            return {n: why for n, why in bad.items() if n in nodes}

    return Check


class _Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _watch(tmp_path: Path, me: str, clock: _Clock) -> SupervisorWatch:
    nodes = ["frontier00042", "frontier00043", "frontier00044", "frontier00045", "frontier00046"]
    return SupervisorWatch("7", tmp_path, "0", me, nodes, clock=clock)


def test_the_watchers_ping_often_the_others_rarely(tmp_path):
    _record(tmp_path)
    clock = _Clock()
    assert _watch(tmp_path, "frontier00043", clock).period == janitor.CHECK_S
    assert _watch(tmp_path, "frontier00046", clock).period == janitor.FAR_CHECK_S


def test_an_answering_supervisor_costs_no_file_and_no_slurm_call(tmp_path, monkeypatch):
    beacon = succession.Beacon("tok", 0)
    try:
        _record(tmp_path, beacon)
        clock = _Clock()
        watch = _watch(tmp_path, "frontier00043", clock)
        monkeypatch.setattr(succession, "read", lambda *_: pytest.fail("read the job dir at steady state"))
        monkeypatch.setattr(janitor, "job_info", lambda *_: pytest.fail("asked Slurm at steady state"))
        for _ in range(20):
            clock.t += janitor.CHECK_S
            watch.check()
    finally:
        beacon.close()


def test_a_silent_supervisor_on_a_live_node_is_asked_about_at_most_every_30_s(tmp_path, monkeypatch):
    _record(tmp_path)  # its beacon answers nothing
    clock, asked = _Clock(), []
    watch = _watch(tmp_path, "frontier00043", clock)
    monkeypatch.setattr(succession, "ping", lambda *a, **k: None)

    class Info:
        batch, nodes = True, ["frontier00042", "frontier00043"]

    monkeypatch.setattr(janitor, "job_info", lambda *_: asked.append(clock.t) or Info)
    monkeypatch.setattr(janitor, "NodeCheck", _checks({}))  # Slurm and the probe: the node is alive
    for _ in range(60):
        clock.t += janitor.CHECK_S
        watch.check()
    assert asked and asked[0] - 1000.0 >= succession.read(tmp_path).loss_timeout
    assert all(b - a >= janitor.ASK_SLURM_S for a, b in zip(asked, asked[1:])), asked
    assert not list(tmp_path.glob("supervisor-claim-*"))


@pytest.mark.parametrize("loss_timeout, silence", [(1.5, 1.5), (0.0, janitor.SILENCE_S)])
def test_the_supervisor_is_a_suspect_after_the_runs_loss_timeout(tmp_path, monkeypatch, loss_timeout, silence):
    """As an agent's peer is (--loss-timeout); with the heartbeats off (0), after janitor.SILENCE_S."""
    _record(tmp_path, loss_timeout=loss_timeout)
    clock, asked = _Clock(), []
    watch = _watch(tmp_path, "frontier00043", clock)
    monkeypatch.setattr(succession, "ping", lambda *a, **k: None)

    class Info:
        batch, nodes = True, ["frontier00042", "frontier00043"]

    monkeypatch.setattr(janitor, "job_info", lambda *_: asked.append(clock.t - 1000.0) or Info)
    monkeypatch.setattr(janitor, "NodeCheck", _checks({}))
    while not asked and clock.t < 1100:
        clock.t += 0.25
        watch.check()
    assert asked and silence <= asked[0] < silence + 0.5, asked


def test_a_successor_that_took_over_is_watched_instead(tmp_path, monkeypatch):
    _record(tmp_path)
    clock = _Clock()
    watch = _watch(tmp_path, "frontier00043", clock)
    monkeypatch.setattr(succession, "ping", lambda *a, **k: None)
    dataclasses.replace(succession.read(tmp_path), generation=1, host="frontier00043").write(tmp_path)
    monkeypatch.setattr(janitor, "job_info", lambda *_: pytest.fail("a successor is known: nothing to ask"))
    clock.t += succession.read(tmp_path).loss_timeout + 1
    watch.check()
    assert watch.record.generation == 1 and watch.record.host == "frontier00043"


def test_the_supervisors_lost_node_makes_one_janitor_its_successor(tmp_path, monkeypatch):
    _record(tmp_path)
    clock, did = _Clock(), []
    monkeypatch.setattr(succession, "ping", lambda *a, **k: None)

    class Info:
        batch, nodes = True, ["frontier00043", "frontier00044"]

    monkeypatch.setattr(janitor, "job_info", lambda *_: Info)
    monkeypatch.setattr(janitor, "NodeCheck", _checks({"frontier00042": "left the allocation (state DOWN*)"}))
    monkeypatch.setattr(janitor, "_lost", lambda *a: did.append(a))
    first, second = (_watch(tmp_path, me, clock) for me in ("frontier00043", "frontier00044"))
    clock.t += succession.read(tmp_path).loss_timeout + 1
    first.check()
    second.check()
    assert len(did) == 1 and did[0][4] == 1 and did[0][5] == "left the allocation (state DOWN*)", did


def test_a_sigterm_in_the_janitors_requeue_waits_for_its_end_then_its_handler_runs():
    """The requeue's SIGTERM reaches the janitor's own step: state.json is written before the handler exits."""
    import signal

    said = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: said.append(("handler", signum)))
    try:
        with janitor._sigterm_held():
            os.kill(os.getpid(), signal.SIGTERM)
            said.append("state.json")
        assert said == ["state.json", ("handler", signal.SIGTERM)]
        with janitor._sigterm_held():
            pass
        assert len(said) == 2  # none held: none delivered
    finally:
        signal.signal(signal.SIGTERM, previous)
