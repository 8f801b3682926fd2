"""Rebuild planning (pure) and the bundle round trip: which slots a step can be rebuilt on, and a bundle
parsed from bytes checks every manifest and chunk and unpacks into committed rank-store versions."""
import fcntl

import numpy as np
import pytest

from hpcft.agent import status as agent_status
from hpcft.agent.protection.bundle import Bundle, complete_steps, parse, release_others, unpack
from hpcft.agent.protection.codec import Unrecoverable
from hpcft.agent.protection.placement import Scheme, plan
from hpcft.agent.protection.rebuild import lost_slots
from hpcft.errors import CheckpointError, IntegrityError, NoCheckpointError
from hpcft.store import RankStore, chunk_table, job_dir, seal_key


def _mask(n, lost):
    return [i not in lost for i in range(n)]


@pytest.mark.parametrize("scheme,n,bundles_lost,records_lost,ok", [
    (Scheme("xor", group=4), 4, {1}, {1}, True),
    (Scheme("xor", group=4), 4, {1, 2}, {1, 2}, False),
    (Scheme("xor", group=4), 4, {1}, {1, 2}, False),          # a survivor's parity is lost too
    (Scheme("xor", group=4), 8, {1, 5}, {1, 5}, True),        # one per set
    (Scheme("rs", group=4, losses=2), 4, {0, 3}, {0, 3}, True),
    (Scheme("rs", group=4, losses=2), 4, {0, 1, 2}, {0, 1, 2}, False),
    (Scheme("partner", distance=1), 4, {2}, {2}, True),
    (Scheme("partner", distance=1), 4, {2, 3}, {2, 3}, False),  # 3 held 2's copy
    (Scheme("partner", distance=2), 4, {0, 1}, {0, 1}, True),
    (Scheme("none"), 4, {0}, set(), False),
    (Scheme("xor", group=4), 4, set(), {0, 1, 2, 3}, True),   # nothing lost: nothing to do
])
def test_lost_slots_names_the_slots_to_rebuild_or_refuses(scheme, n, bundles_lost, records_lost, ok):
    placement = plan(n, scheme)
    if ok:
        assert lost_slots(placement, _mask(n, bundles_lost), _mask(n, records_lost)) == sorted(bundles_lost)
    else:
        with pytest.raises(Unrecoverable):
            lost_slots(placement, _mask(n, bundles_lost), _mask(n, records_lost))


def _commit(root, rank, step, nbytes):
    store = RankStore("7", rank, root=root)
    slot = store.begin(nbytes)
    data = np.random.default_rng(rank + step).integers(0, 256, nbytes, dtype=np.uint8)
    slot.array[:nbytes] = data
    store.commit(slot, {"step": step, "rank": rank, "data_bytes": nbytes, "time": 1.5e9 + 0.1,
                        "chunks": chunk_table(data, 1000, seal_key({"step": step}))})
    store.close()


def _files(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("rank-*/slot-*.json")}


def test_a_bundle_round_trips_into_identical_committed_versions(tmp_path):
    src, dst = tmp_path / "a", tmp_path / "b"
    src.mkdir(), dst.mkdir()
    for rank in (4, 5):
        _commit(src, rank, 3, 2500 + rank)
    b = Bundle(3, complete_steps(job_dir(src, "7"))[3])
    payload = np.concatenate(b.piece(0, b.size))
    unpack(parse(payload, 3), "7", dst)
    assert _files(dst) == _files(src)
    got = complete_steps(job_dir(dst, "7"))[3]
    for rank, held in got.items():
        n = held.manifest["data_bytes"]
        assert held.data_path.read_bytes()[:n] == (b.held[rank].data_path.read_bytes()[:n])
    assert RankStore("7", 5, root=dst, readonly=True).versions()[0].step == 3


def test_a_damaged_bundle_is_refused_before_anything_is_written(tmp_path):
    src, dst = tmp_path / "a", tmp_path / "b"
    src.mkdir(), dst.mkdir()
    _commit(src, 0, 3, 5000)
    b = Bundle(3, complete_steps(job_dir(src, "7"))[3])
    payload = np.concatenate(b.piece(0, b.size))
    payload[-10] ^= 1
    with pytest.raises(IntegrityError, match="crc32c"):
        parse(payload, 3)
    with pytest.raises(IntegrityError, match="expected step 4"):
        parse(np.concatenate(b.piece(0, b.size)), 4)
    assert not list(dst.iterdir())


def test_wait_ready_gates_on_every_slot_and_reports_failures(tmp_path):
    agent_status.write(tmp_path, "1", 0, phase="ready", rebuilt_step=9, rebuilt=[1])
    with pytest.raises(CheckpointError, match=r"slots \[1\]"):
        agent_status.wait_ready(tmp_path, "1", 2, timeout=0.2, poll=0.05)
    agent_status.write(tmp_path, "1", 1, phase="protecting", rebuilt_step=9, rebuilt=[1])
    assert agent_status.wait_ready(tmp_path, "1", 2, timeout=1) == agent_status.Ready(9, (1,))
    agent_status.write(tmp_path, "2", 0, phase="failed", reason="no_checkpoint", error="nothing")
    with pytest.raises(NoCheckpointError):
        agent_status.wait_ready(tmp_path, "2", 2, timeout=1)
    assert agent_status.read(tmp_path)[0]["tag"] == "2"  # newest launch per slot


def test_a_node_counts_only_its_slots_ranks_not_those_it_ran_before_a_requeue_moved_it(tmp_path):
    """A node that left the allocation with its store and came back in another slot keeps the old ranks' directories:
    counted, they leave no step complete on it, and protection stalls everywhere."""
    for rank, steps in ((2, (8, 9)), (3, (8, 9)), (5, (1, 2))):  # slot 1 of 2 tasks a node; rank 5 from slot 2
        for step in steps:
            _commit(tmp_path, rank, step, 3000)
    job = job_dir(tmp_path, "7")
    assert complete_steps(job) == {}
    mine = complete_steps(job, ranks=range(2, 4))
    assert {s: sorted(v) for s, v in mine.items()} == {8: [2, 3], 9: [2, 3]}
    assert complete_steps(job, ranks=range(0, 2)) == {}  # a slot whose ranks it does not hold yet
    # once a newer step is protected everywhere, the old ranks' memory goes back (not while a process writes them)
    _commit(tmp_path, 6, 1, 3000)
    with open(job / "rank-00006" / "writer.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert release_others(job, range(2, 4), 2, slot=1) == {}  # rank 5 holds step 2: not older
        freed = release_others(job, range(2, 4), 9, slot=1)
    assert list(freed) == [5] and freed[5] >= 2 * 3000
    assert sorted(p.name for p in job.glob("rank-*")) == ["rank-00002", "rank-00003", "rank-00006"]
