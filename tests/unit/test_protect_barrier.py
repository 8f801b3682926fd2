"""The protect pass's commit barrier, on three real agents' meshes (threads, real sockets, real rank stores and pins):
no node lets go of the last protected step (its record, its pinned snapshot) until every node has committed the
newer one. Without it a node lost mid-pass left the survivors on different steps, and the rebuild found none."""
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from hpcft import events
from hpcft.agent.protection import protect
from hpcft.agent.agent import keep_newest_protected, protect_newest
from hpcft.agent.protection.bundle import complete_steps, pin_targets
from hpcft.agent.transport.mesh import Mesh
from hpcft.agent.protection.pins import Pins
from hpcft.agent.protection.placement import Scheme, plan
from hpcft.agent.protection.protect import StaleStep, records
from hpcft.agent.protection.rebuild import rebuild
from hpcft.agent.transport.tcp import TransportError
from hpcft.store import RankStore, chunk_table, job_dir, seal_key, secure_dir
from hpcft.store import manifest as mf
from hpcft.store import pin as store_pin

SECRET = b"b" * 64
NODES = 3
PLACEMENT = plan(NODES, Scheme("xor", group=NODES))


RANKS_PER_NODE = 2  # a node's bundle holds every local rank's snapshot, as on a GPU node


class Node:
    """One node: its root (its /dev/shm), its ranks' stores, its agent's mesh and pins."""

    def __init__(self, tmp: Path, slot: int):
        self.slot, self.root = slot, tmp / f"n{slot}"
        self.root.mkdir()
        self.job = secure_dir(job_dir(self.root, "7"))
        store_pin.announce(self.job)
        self.ranks = [slot * RANKS_PER_NODE + i for i in range(RANKS_PER_NODE)]
        self.stores = [RankStore("7", r, root=self.root) for r in self.ranks]
        self.pins = Pins(f"agent slot {slot}", lease=30)
        self.mesh: Mesh | None = None

    def snapshot(self, step: int, nbytes: int = 50_000, job: str | None = None) -> None:
        """Every rank's version of `step`; with `job`, its manifests name that job (else no job, as by hand)."""
        for rank, store in zip(self.ranks, self.stores):
            slot = store.begin(nbytes)
            data = np.random.default_rng(100 * step + rank).integers(0, 256, nbytes, dtype=np.uint8)
            slot.array[:nbytes] = data
            store.commit(slot, {"step": step, "rank": rank, "data_bytes": nbytes, "time": 1.5e9 + step,
                                "chunks": chunk_table(data, 10_000, seal_key({"step": step})),
                                **({"job_id": job} if job else {})})

    def kept(self, step: int) -> bool:
        """Is `step`'s snapshot pinned in this node's store (as the newest protected step)?"""
        return all(getattr(store_pin.read(path), "step", None) == s
                   for path, s in pin_targets(step, complete_steps(self.job)[step]))

    def close(self) -> None:
        self.pins.close()
        if self.mesh is not None:
            self.mesh.close()
        for store in self.stores:
            store.close()


def _connect(nodes: list[Node], rdv: Path, tag: str) -> None:
    def join(n: Node) -> None:
        if n.mesh is not None:
            n.mesh.close()
        n.mesh = Mesh(n.slot, NODES, SECRET, rdv, host="127.0.0.1", bind="127.0.0.1", timeout=30, tag=tag,
                      peers=PLACEMENT.exchange_peers(n.slot))

    rdv.mkdir(exist_ok=True)
    assert _on_all(nodes, join) == [None] * len(nodes)


@pytest.fixture
def nodes(tmp_path):
    made = [Node(tmp_path, s) for s in range(NODES)]
    _connect(made, tmp_path / "rdv", "t")
    yield made
    for n in made:
        n.close()


def _on_all(nodes: list[Node], fn) -> list:
    """fn(node) on every node at once (a collective): each one's result or exception."""
    out: list = [None] * len(nodes)

    def one(i: int) -> None:
        try:
            out[i] = fn(nodes[i])
        except Exception as exc:  # noqa: BLE001 - the test looks at which
            out[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a collective hung"
    return out


def _protect(n: Node):
    return protect_newest(n.mesh, PLACEMENT, n.job, n.pins)


def _on_slot(monkeypatch, slot: int, after):
    """Run `after(mesh, bundle)` on one slot once its pass has exchanged everything, before it commits."""
    real = protect._parity

    def parity(mesh, placement, bundle, data, sizes):
        out = real(mesh, placement, bundle, data, sizes)
        if mesh.slot == slot:
            after(mesh, bundle)
        return out

    monkeypatch.setattr(protect, "_parity", parity)


def _first_protected(nodes: list[Node]) -> None:
    for n in nodes:
        n.snapshot(1)
    assert [r.step for r in _on_all(nodes, _protect)] == [1] * NODES
    assert all(n.kept(1) and sorted(records(n.job)) == [1] for n in nodes)
    for n in nodes:
        n.snapshot(2)


def test_a_step_reused_on_one_node_is_withdrawn_everywhere_and_the_last_protected_one_kept(nodes, monkeypatch):
    _first_protected(nodes)

    def reuse(_mesh, bundle):  # the trainers rewrote the slot under the pass (their pin broken)
        path = bundle.held[max(bundle.held)].manifest_path  # one of the node's ranks
        path.write_bytes(path.read_bytes() + b" ")

    _on_slot(monkeypatch, 2, reuse)
    out = _on_all(nodes, _protect)
    assert all(isinstance(e, StaleStep) for e in out), out
    assert "on another node" in str(out[0]) and "on another node" not in str(out[2])
    for n in nodes:
        assert sorted(records(n.job)) == [1], n.slot  # no node kept a record of step 2 that others lack
        assert n.kept(1), n.slot
        assert not list((n.job / "protect").glob("step-2.*")), n.slot


def _lose_slot_2_mid_pass(nodes: list[Node], monkeypatch) -> None:
    """Step 1 protected, then slot 2's agent dies in step 2's pass after the exchange, before it commits."""
    _first_protected(nodes)

    def die(mesh, _bundle):  # its sockets close, as a killed process's do
        mesh.close()
        raise RuntimeError("slot 2's agent is gone")

    _on_slot(monkeypatch, 2, die)
    out = _on_all(nodes, _protect)
    monkeypatch.undo()
    assert all(isinstance(e, TransportError) for e in out[:2]) and isinstance(out[2], RuntimeError), out


def test_a_node_lost_before_it_commits_leaves_the_survivors_holding_the_last_protected_step(nodes, monkeypatch):
    _lose_slot_2_mid_pass(nodes, monkeypatch)
    for n in nodes[:2]:
        assert sorted(records(n.job)) == [1, 2], n.slot  # step 2 stays beside step 1, for the rebuild to weigh
        assert n.kept(1), n.slot  # the snapshot of step 1 is still pinned: the trainers cannot recycle it


def test_the_step_kept_at_start_is_the_newest_one_protected_on_every_node(nodes):
    _first_protected(nodes)
    # node 0 committed step 2 alone (its peers were lost before they did): its record protects nothing
    pdir = nodes[0].job / "protect"
    mf.write_atomic(pdir / "step-2.json", {**mf.read(pdir / "step-1.json"), "step": 2})
    assert sorted(records(nodes[0].job)) == [1, 2]
    assert _on_all(nodes, lambda n: keep_newest_protected(n.mesh, n.job, n.pins)) == [1] * NODES
    assert all(n.kept(1) for n in nodes)


def test_after_a_node_lost_mid_pass_the_rebuild_finds_a_step_and_drops_the_records_newer_than_it(
        nodes, monkeypatch, tmp_path):
    _lose_slot_2_mid_pass(nodes, monkeypatch)
    # node 0 alone went on to step 3 and holds a record of it that protects nothing (its data file gone, too)
    nodes[0].snapshot(3)
    pdir = nodes[0].job / "protect"
    mf.write_atomic(pdir / "step-3.json", {**mf.read(pdir / "step-2.json"), "step": 3})
    nodes[2].close()  # a replacement node in slot 2: nothing of the job in its memory
    shutil.rmtree(nodes[2].root)
    nodes[2] = Node(tmp_path, 2)
    _connect(nodes, tmp_path / "rdv", "after")
    out = _on_all(nodes, lambda n: rebuild(n.mesh, PLACEMENT, n.job, n.pins, "7", str(n.root)))
    assert [(o.step, o.rebuilt) for o in out] == [(2, (2,))] * NODES, out
    assert 3 not in records(nodes[0].job)  # the trainers resume from 2 and write 3 anew
    assert all(2 in complete_steps(n.job) and 2 in records(n.job) for n in nodes)
    assert _on_all(nodes, lambda n: keep_newest_protected(n.mesh, n.job, n.pins)) == [2] * NODES


def test_the_rebuild_skips_a_step_of_another_job_and_leaves_it_in_place(nodes, monkeypatch, tmp_path):
    monkeypatch.setenv("HPCFT_EVENT_DIR", str(tmp_path / "events"))
    monkeypatch.delenv("HPCFT_ADOPT", raising=False)
    for n in nodes:
        n.snapshot(1, job="7")
    assert [r.step for r in _on_all(nodes, _protect)] == [1] * NODES
    for n in nodes:  # job A's step 2 copied into every node's store, and protected by the agents
        n.snapshot(2, job="A")
    assert [r.step for r in _on_all(nodes, _protect)] == [2] * NODES
    nodes[2].close()  # a replacement node in slot 2: nothing of the job in its memory
    shutil.rmtree(nodes[2].root)
    nodes[2] = Node(tmp_path, 2)
    _connect(nodes, tmp_path / "rdv", "after")
    out = _on_all(nodes, lambda n: rebuild(n.mesh, PLACEMENT, n.job, n.pins, "7", str(n.root)))
    assert [(o.step, o.rebuilt) for o in out] == [(1, (2,))] * NODES, out  # its own step, not job A's newer one
    assert all(2 in complete_steps(n.job) for n in nodes[:2])  # job A's versions stay where they were
    assert 2 not in complete_steps(nodes[2].job)
    refused = [e for e in events.read(tmp_path / "events") if e["event"] == "restore_foreign"]
    assert {e["slot"] for e in refused} == {0, 1} and {(e["job"], e["level"]) for e in refused} == {("A", "ERROR")}
