"""The protect pass with real agent processes on this machine over authenticated TCP: four "nodes" (each its own
store root, two ranks each; tests/integration/protect_nodes.py). What each node keeps must be byte-identical to the
parity (or partner copy) of the nodes' bundles, and must rebuild a lost node's bundle exactly. The same cases over MPI
are in test_agent_protect_mpi.py."""
import json
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from protect_nodes import (JOB, NODES, RANKS_PER_NODE, Cluster, bundle_bytes, check, check_parity, check_partner,
                           check_rebuild, commit_version, data, held, make_cluster, node_files, replace, run_agents,
                           size, start_agents)

from hpcft import events
from hpcft.agent import status as agent_status
from hpcft.agent.protection.bundle import Bundle, complete_steps, local_versions
from hpcft.agent.protection.codec import codec_for
from hpcft.agent.protection.placement import Scheme, plan
from hpcft.agent.protection.protect import records
from hpcft.agent.protection.stripes import encode_set
from hpcft.errors import NoCheckpointError
from hpcft.store import RankStore, job_dir
from hpcft.store import pin as store_pin


@pytest.fixture
def cluster(tmp_path) -> Cluster:
    return make_cluster(tmp_path)


@pytest.mark.parametrize("scheme", [Scheme("xor", group=4), Scheme("rs", group=4, losses=2)], ids=["xor", "rs"])
def test_parity_on_every_node_is_exact_and_rebuilds_lost_nodes(cluster, scheme):
    check_parity(cluster, scheme, run_agents(cluster, scheme, scheme.name))


def test_partner_holds_an_exact_copy_of_its_neighbours_bundle(cluster):
    scheme = Scheme("partner", distance=1)
    check_partner(cluster, "partner", run_agents(cluster, scheme, "partner", lag_bound=1))  # kept to: the cap


def test_a_corrupt_chunk_stops_protection_of_that_step_with_an_event(cluster):
    corrupt = complete_steps(job_dir(cluster.roots[2], JOB))[2][4].data_path
    with open(corrupt, "r+b") as fh:
        fh.seek(1000)
        byte = fh.read(1)
        fh.seek(1000)
        fh.write(bytes([byte[0] ^ 0xFF]))
    done = run_agents(cluster, Scheme("xor", group=4), tag="corrupt", rounds=3)
    check(done)
    assert all("protected=None" in p.stdout for p in done)
    skipped = [e for e in events.read(cluster.shared / "events") if e["event"] == "protect_skipped"]
    # found once: not pinned and read again every round (a relaunched trainer's restore withdraws it meanwhile)
    assert len(skipped) == 1 and skipped[0]["slot"] == 2 and skipped[0]["step"] == 2
    assert all(2 not in records(job_dir(root, JOB)) for root in cluster.roots)


# -- rebuild onto replacement nodes ---------------------------------------------------------------------

@pytest.mark.parametrize("scheme,lost", [(Scheme("xor", group=4), {1}), (Scheme("partner", distance=1), {2}),
                                         (Scheme("rs", group=4, losses=2), {0, 3})], ids=["xor", "partner", "rs"])
def test_rebuild_puts_the_lost_nodes_snapshot_back_byte_identical(cluster, tmp_path, scheme, lost):
    check(run_agents(cluster, scheme, "p"))
    check_rebuild(cluster, scheme, lost, tmp_path)


def test_two_nodes_of_one_xor_set_lost_is_no_checkpoint_and_writes_nothing(cluster, tmp_path):
    scheme = Scheme("xor", group=4)
    check(run_agents(cluster, scheme, "p", rounds=2))
    now = replace(cluster, {1, 2}, tmp_path)
    check(run_agents(now, scheme, "r", "--rebuild"), code=3)
    for i in (1, 2):
        assert not list(now.roots[i].rglob("*.json")), "a node that could not be rebuilt must hold no partial version"
    failed = [e for e in events.read(now.shared / "events") if e["event"] == "rebuild_failed"]
    assert len(failed) == NODES and "persistent tier" in failed[0]["reason"]
    states = agent_status.read(now.shared, "r")
    assert {s["phase"] for s in states.values()} == {"failed"}
    with pytest.raises(NoCheckpointError):
        agent_status.wait_ready(now.shared, "r", NODES, timeout=5)


def test_a_corrupt_parity_chunk_is_detected_and_an_older_step_is_rebuilt(cluster, tmp_path):
    scheme = Scheme("xor", group=4)
    check(run_agents(cluster, scheme, "p", rounds=2))
    assert sorted(records(job_dir(cluster.roots[2], JOB))) == [1, 2]
    step1 = node_files(cluster.roots[1])
    parity = records(job_dir(cluster.roots[2], JOB))[2].path.with_suffix(".data")
    with open(parity, "r+b") as fh:
        fh.seek(5)
        b = fh.read(1)
        fh.seek(5)
        fh.write(bytes([b[0] ^ 1]))
    now = replace(cluster, {1}, tmp_path)
    check(run_agents(now, scheme, "r", "--rebuild"))
    got = node_files(now.roots[1])
    assert got and got == {k: v for k, v in step1.items() if k in got}
    assert {json.loads(v)["step"] for k, v in got.items() if k.endswith(".json")} == {1}
    kinds = [e["event"] for e in events.read(now.shared / "events")]
    assert "protect_chunk_lost" in kinds and "rebuild_fallback" in kinds
    assert agent_status.wait_ready(now.shared, "r", NODES, timeout=5).step == 1


def test_an_agent_killed_mid_protection_loses_nothing_and_the_relaunch_completes(cluster):
    scheme = Scheme("xor", group=4)
    procs = start_agents(cluster, scheme, "k", rate=400000)  # ~2 s per pass
    deadline = time.monotonic() + 60
    while not (job_dir(cluster.roots[1], JOB) / "protect" / "step-2.data").exists():
        assert time.monotonic() < deadline, "the protect pass never started"
        time.sleep(0.02)
    procs[1].send_signal(signal.SIGKILL)
    for p in procs:
        p.wait(timeout=60)
    assert all(2 not in records(job_dir(root, JOB)) for root in cluster.roots), "the kill came after the pass"
    check(run_agents(cluster, scheme, "k2"))
    pset = plan(NODES, scheme).sets[0]
    expected = encode_set(pset, [bundle_bytes(root, 2) for root in cluster.roots], codec_for("xor", pset.size, 1))
    for root, want in zip(cluster.roots, expected):
        assert held(root, 2)[1].tobytes() == want.tobytes()
        assert [p.name for p in (job_dir(root, JOB) / "protect").glob("*.data")] == ["step-2.data"]


# -- pins: a slow pass is never overtaken by trainers snapshotting every step -------------------------------

def test_a_slow_agent_protects_a_consistent_step_while_trainers_snapshot_every_step(cluster, tmp_path):
    roots, shared = cluster.roots, cluster.shared
    scheme = Scheme("xor", group=4)
    procs = start_agents(cluster, scheme, "slow", rounds=0, interval=0.1,
                          rate=300000)  # ~5 s a pass: the trainers commit ~50 steps meanwhile
    while not all(store_pin.announced(job_dir(root, JOB)) for root in roots):  # trainers start after their agent
        assert all(p.poll() is None for p in procs), "an agent died"
        time.sleep(0.05)
    stores = [RankStore(JOB, i * RANKS_PER_NODE + r, root=root) for i, root in enumerate(roots)
              for r in range(RANKS_PER_NODE)]
    assert {s.nslots for s in stores} == {4}  # keep + 1 + the spare slot for the agent's pins
    manifests: dict[tuple[int, int], bytes] = {}
    stop, errors = threading.Event(), []

    def trainers() -> None:  # every rank snapshots a step every 0.1 s, like a fast training loop
        step = 3
        while not stop.wait(0.1):
            for store in stores:
                try:
                    manifests[(store.rank, step)] = commit_version(store, step, size(store.rank))
                except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                    errors.append(exc)
            step += 1

    writer = threading.Thread(target=trainers)
    writer.start()
    try:
        deadline = time.monotonic() + 90
        while len(_protected_by(shared)) < NODES:  # every node committed its record of one step
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "no pass completed"
            time.sleep(0.1)
        time.sleep(1.0)  # ten more snapshots: the newest protected step stays held (kept pinned) on every node
        for root in roots:
            newest = max(records(job_dir(root, JOB)))
            assert newest in complete_steps(job_dir(root, JOB)), "the newest protected step was recycled"
    finally:
        stop.set()
        writer.join()
        for p in procs:
            p.kill()
            p.wait()
        for store in stores:
            store.close()
    every = events.read(shared / "events")
    (step,) = {_protected_by(shared)[i] for i in range(NODES)}
    assert not errors and max(s for _, s in manifests) > step + 3, "the trainers did not keep snapshotting"
    assert [e for e in every if e["event"] == "protect_stale"] == []
    # the record is the parity of exactly the bytes that step held (rebuilt here from what the trainers wrote)
    bundles = []
    for i in range(NODES):
        job = job_dir(tmp_path / f"copy{i}", JOB)
        for r in range(i * RANKS_PER_NODE, (i + 1) * RANKS_PER_NODE):
            rdir = job / f"rank-{r:05d}"
            rdir.mkdir(parents=True)
            (rdir / "slot-0.json").write_bytes(manifests.get((r, step)) or _committed_before(roots[i], r, step))
            data(r, step, size(r)).tofile(rdir / "slot-0.data")
            for f in rdir.iterdir():
                f.chmod(0o600)  # as the store writes them: the agent reads no store file open to others
        b = Bundle(step, complete_steps(job)[step])
        bundles.append(np.concatenate(b.piece(0, b.size)))
    pset = plan(NODES, scheme).sets[0]
    expected = encode_set(pset, bundles, codec_for("xor", pset.size, 1))
    for root, want in zip(roots, expected):
        assert held(root, step)[1].tobytes() == want.tobytes()


def _protected_by(shared: Path) -> dict[int, int]:
    """Slot → the first step it recorded a protection pass of."""
    out: dict[int, int] = {}
    for e in events.read(shared / "events"):
        if e["event"] == "snapshot_protected":
            out.setdefault(e["slot"], e["step"])
    return out


def _committed_before(root: Path, rank: int, step: int) -> bytes:
    """The manifest of a step the fixture committed (before the trainers' thread started)."""
    (held,) = [h for h in local_versions(job_dir(root, JOB)).get(step, {}).values() if h.rank == rank]
    return held.manifest_bytes
