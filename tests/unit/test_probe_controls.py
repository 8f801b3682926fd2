"""The probe of the agents' suspects, timed against a few healthy-looking nodes (hpcft/launch/policy/failures.py
`probe_deadline`, `control_nodes`; hpcft/launch/node/nodecheck.py): a node silent past --loss-timeout that does not
answer a probe its peers answer at once is bad within seconds, not at --probe-timeout; a slow cluster slows the
controls too, and the suspect gets longer."""
import time

import pytest

import fake_probe  # tests/unit is on sys.path (pytest's rootdir insertion)

from hpcft.launch.node import nodecheck
from hpcft.launch.node.nodecheck import NodeCheck
from hpcft.launch.policy.failures import CONTROL_FACTOR, CONTROL_FLOOR_S, control_nodes, probe_deadline


def test_without_controls_the_probe_waits_its_timeout():
    assert probe_deadline(15.0, None) == 15.0 and probe_deadline(15.0, []) == 15.0


def test_with_controls_a_suspect_gets_a_multiple_of_the_slowest_answer_within_floor_and_timeout():
    assert probe_deadline(15.0, [0.1, 0.2]) == CONTROL_FLOOR_S  # a quick cluster: the floor
    assert probe_deadline(15.0, [0.2, 1.0]) == pytest.approx(CONTROL_FACTOR * 1.0)  # the slowest control counts
    assert probe_deadline(15.0, [6.0]) == 15.0  # a loaded cluster: never past --probe-timeout


def test_controls_are_the_suspects_neighbours_and_never_suspects():
    slots = [f"frontier{i:05d}" for i in range(1, 11)]
    assert control_nodes(slots, ["frontier00005"]) == ["frontier00004", "frontier00006", "frontier00003"]
    assert control_nodes(slots, ["frontier00001"], count=2) == ["frontier00002", "frontier00003"]
    assert control_nodes(slots[:2], slots[:2]) == []
    assert control_nodes(slots[:3], []) == slots[:3]


class _Runner:
    """Runs a command per node instead of the probe's srun (the probe's argv is tested in test_launch_golden): a
    healthy node echoes its name, a frozen one never answers, an unlaunched one's step is never created."""

    def __init__(self, frozen: set[str], unlaunched: set[str] = frozenset()):
        self.frozen, self.unlaunched = frozen, unlaunched

    def popen(self, argv, *, env=None, **kwargs):
        return fake_probe.probe(argv, self.frozen, self.unlaunched, **kwargs)


def _check(frozen: set[str], timeout: float, unlaunched: set[str] = frozenset()) -> NodeCheck:
    said: list = []
    check = NodeCheck(_Runner(frozen, unlaunched), "1", {}, timeout, lambda *a, **k: said.append((a, k)))
    check._slurm_marked = lambda nodes, closed: {}  # no Slurm here: only the probe decides
    return check


def test_a_frozen_suspect_is_bad_once_the_controls_answered_not_at_the_timeout(monkeypatch):
    monkeypatch.setattr(nodecheck, "SLURM_EVERY_S", 3600.0)
    started = time.monotonic()
    bad = _check({"n3"}, timeout=60.0).probe(["n3"], controls=["n2", "n4"])
    assert list(bad) == ["n3"] and "2 other node(s) answered within" in bad["n3"], bad
    assert time.monotonic() - started < 30.0, "named long before --probe-timeout (60 s)"


def test_a_suspect_that_answers_is_not_bad_and_a_frozen_control_leaves_the_timeout(monkeypatch):
    monkeypatch.setattr(nodecheck, "SLURM_EVERY_S", 3600.0)
    assert _check(set(), timeout=30.0).probe(["n3"], controls=["n2"]) == {}
    bad = _check({"n2", "n3"}, timeout=1.0).probe(["n3"], controls=["n2"])  # no control answered: the timeout
    assert sorted(bad) == ["n2", "n3"] and bad["n3"] == "probe did not answer within 1 s", bad


def test_a_frozen_suspect_with_a_frozen_control_is_bad_once_half_the_controls_answered_not_at_the_timeout(monkeypatch):
    """Two nodes of a set lost at once (a switch, a rack): the agents name one, the other is among its controls. It
    never answers, so 'every control answered' never came and the suspect waited --probe-timeout (5 s in hpcft chaos,
    15 s by default); half the controls answering times a healthy answer. The silent control is not judged by that
    (a control's probe times, its node was not suspected): the agents name it (as late, both are probed ahead)."""
    monkeypatch.setattr(nodecheck, "SLURM_EVERY_S", 3600.0)
    started = time.monotonic()
    bad = _check({"n3", "n4"}, timeout=60.0).probe(["n3"], controls=["n2", "n4", "n5"])
    assert sorted(bad) == ["n3"] and "2 other node(s) answered within" in bad["n3"], bad
    assert time.monotonic() - started < 30.0, "named long before --probe-timeout (60 s)"
    bad = _check({"n3", "n4", "n5"}, timeout=1.0).probe(["n3"], controls=["n2", "n4", "n5"])  # one of three: not half
    assert sorted(bad) == ["n3", "n4", "n5"] and bad["n3"] == "probe did not answer within 1 s", bad


def test_a_probe_whose_step_the_controller_has_not_created_is_not_the_nodes_fault_until_a_longer_wait(monkeypatch):
    """A busy slurmctld (hundreds of nodes' steps at once) delays the probe's step: the node has not been asked yet,
    so --probe-timeout does not run for it; past UNLAUNCHED_FACTOR × the timeout it is bad, and the reason says
    Slurm never launched the task. A node that was asked and is silent is still bad at the timeout."""
    monkeypatch.setattr(nodecheck, "SLURM_EVERY_S", 3600.0)
    started = time.monotonic()
    bad = _check({"n2"}, timeout=1.0, unlaunched={"n3"}).probe(["n2", "n3"])
    took = time.monotonic() - started
    assert bad["n2"] == "probe did not answer within 1 s", bad
    assert bad["n3"].startswith("Slurm did not launch the probe's task within 3 s"), bad
    assert nodecheck.UNLAUNCHED_FACTOR * 1.0 <= took < 20.0


def test_a_probe_for_no_suspicion_ends_judging_nothing_once_until_says_a_better_check_is_due(monkeypatch):
    """While the agents get ready, every slot is probed every few seconds; an agent that fails meanwhile names its
    suspect, which is probed beside controls next: the blind probe must not hold that up to --probe-timeout."""
    monkeypatch.setattr(nodecheck, "SLURM_EVERY_S", 3600.0)
    started = time.monotonic()
    bad = _check({"n3"}, timeout=60.0).probe(["n1", "n2", "n3"], until=lambda: time.monotonic() - started > 1.0)
    assert bad == {} and time.monotonic() - started < 10.0
