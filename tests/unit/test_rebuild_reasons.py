"""Why a rebuild fell back, in its own words (issue 34, item 6): a step whose protection records exist but are
damaged is "damaged", not "not protected yet" (the reason travels into the agents' failure, the launch's lost
progress and the run's summary). Three real agents' meshes on threads, as in test_protect_barrier.py."""
import shutil

import pytest
from test_protect_barrier import PLACEMENT, Node, _connect, _on_all, _protect, nodes  # noqa: F401 - the fixture

from hpcft import events
from hpcft.agent.protection.rebuild import rebuild
from hpcft.errors import NoCheckpointError


def _replace_slot_2(nodes, tmp_path):
    nodes[2].close()  # a replacement node in slot 2: nothing of the job in its memory
    shutil.rmtree(nodes[2].root)
    nodes[2] = Node(tmp_path, 2)
    _connect(nodes, tmp_path / "rdv", "after")


def test_a_step_whose_survivors_parity_is_truncated_is_said_damaged_not_unprotected(nodes, monkeypatch, tmp_path):
    monkeypatch.setenv("HPCFT_EVENT_DIR", str(tmp_path / "events"))
    for n in nodes:
        n.snapshot(1)
    assert [r.step for r in _on_all(nodes, _protect)] == [1] * len(nodes)
    for n in nodes[:2]:  # the survivors' parity of step 1, cut short
        with open(n.job / "protect" / "step-1.data", "r+b") as fh:
            fh.truncate(100)
    _replace_slot_2(nodes, tmp_path)
    out = _on_all(nodes, lambda n: rebuild(n.mesh, PLACEMENT, n.job, n.pins, "7", str(n.root)))
    assert all(isinstance(o, NoCheckpointError) for o in out), out
    assert all("damaged" in str(o) and "not protected yet" not in str(o) for o in out), out
    fallbacks = [e for e in events.read(tmp_path / "events") if e["event"] == "rebuild_fallback"]
    assert fallbacks and all("damaged" in e["reason"] and "not protected" not in e["reason"] for e in fallbacks)
    assert {e["level"] for e in fallbacks} == {"WARNING"}, fallbacks  # not the usual newest step's INFO


def test_a_step_no_slot_protected_is_still_said_not_protected_yet(nodes, monkeypatch, tmp_path):
    monkeypatch.setenv("HPCFT_EVENT_DIR", str(tmp_path / "events"))
    for n in nodes:
        n.snapshot(1)
    assert [r.step for r in _on_all(nodes, _protect)] == [1] * len(nodes)
    for n in nodes:
        n.snapshot(2)  # never protected
    _replace_slot_2(nodes, tmp_path)
    out = _on_all(nodes, lambda n: rebuild(n.mesh, PLACEMENT, n.job, n.pins, "7", str(n.root)))
    assert [o.step for o in out] == [1] * len(nodes), out
    fallbacks = [e for e in events.read(tmp_path / "events") if e["event"] == "rebuild_fallback"]
    assert fallbacks and all("not protected yet" in e["reason"] for e in fallbacks), fallbacks


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.delenv("HPCFT_ADOPT", raising=False)
