"""The protect pass with real agent processes on this machine: four "nodes" (each its own store root,
two ranks each), agents meshed over authenticated TCP. What each node keeps must be byte-identical to
the parity (or partner copy) of the nodes' bundles, and must rebuild a lost node's bundle exactly."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hpcft import events
from hpcft.agent import secret as job_secret
from hpcft.agent.bundle import Bundle, complete_steps
from hpcft.agent.codec import codec_for
from hpcft.agent.placement import Scheme, plan
from hpcft.agent.protect import records
from hpcft.agent.stripes import encode_set, rebuild_partner, rebuild_set
from hpcft.store import RankStore, crc32c, job_dir

JOB = "4242"
NODES = 4
RANKS_PER_NODE = 2
CHUNK = 64 << 10


def _write_version(root: Path, rank: int, step: int, nbytes: int) -> None:
    store = RankStore(JOB, rank, root=root)
    slot = store.begin(nbytes)
    data = np.random.default_rng(rank * 1000 + step).integers(0, 256, nbytes, dtype=np.uint8)
    slot.array[:nbytes] = data
    chunks = [[lo, min(CHUNK, nbytes - lo), crc32c(data[lo:lo + CHUNK])] for lo in range(0, nbytes, CHUNK)]
    store.commit(slot, {"step": step, "rank": rank, "data_bytes": nbytes, "chunk_bytes": CHUNK, "chunks": chunks})
    store.close()


@pytest.fixture
def cluster(tmp_path):
    """Four node roots with steps 1 and 2 committed by two ranks each (sizes differ per rank)."""
    roots = [tmp_path / f"node{i}" for i in range(NODES)]
    for i, root in enumerate(roots):
        root.mkdir()
        for r in range(RANKS_PER_NODE):
            rank = i * RANKS_PER_NODE + r
            for step in (1, 2):
                _write_version(root, rank, step, 300_000 + 17_000 * rank)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    return roots, shared, job_secret.create(shared)


def _run_agents(roots, shared, secret, scheme: Scheme, tag: str) -> list[subprocess.CompletedProcess]:
    procs = []
    for i, root in enumerate(roots):
        env = {**os.environ, "HPCFT_STORE_ROOT": str(root), "HPCFT_EVENT_DIR": str(shared / "events")}
        argv = [sys.executable, "-m", "hpcft.agent", "--job-id", JOB, "--slot", str(i), "--slots", str(NODES),
                "--rendezvous", str(shared), "--secret", str(secret), "--scheme", scheme.name,
                "--group", str(scheme.group), "--losses", str(scheme.losses), "--distance", str(scheme.distance),
                "--tag", tag]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def _bundle_bytes(root: Path, step: int) -> np.ndarray:
    b = Bundle(step, complete_steps(job_dir(root, JOB))[step])
    return np.concatenate(b.piece(0, b.size))


def _held(root: Path, step: int) -> tuple[dict, np.ndarray]:
    rec = records(job_dir(root, JOB))[step]
    data = np.fromfile(rec.path.with_suffix(".data"), dtype=np.uint8)[:rec.meta["bytes"]]
    return rec.meta, data


@pytest.mark.parametrize("scheme", [Scheme("xor", group=4), Scheme("rs", group=4, losses=2)], ids=["xor", "rs"])
def test_parity_on_every_node_is_exact_and_rebuilds_lost_nodes(cluster, scheme):
    roots, shared, secret = cluster
    done = _run_agents(roots, shared, secret, scheme, tag=scheme.name)
    assert [p.returncode for p in done] == [0] * NODES, [p.stderr[-2000:] for p in done]
    assert all("protected=2" in p.stdout for p in done)
    pset = plan(NODES, scheme).sets[0]
    codec = codec_for(scheme.name, pset.size, pset.losses)
    bundles = [_bundle_bytes(root, 2) for root in roots]
    expected = encode_set(pset, bundles, codec)
    held = [_held(root, 2) for root in roots]
    for (meta, data), want in zip(held, expected):
        assert data.tobytes() == want.tobytes()
        assert meta["sizes"] == [b.size for b in bundles]
    lost = {1} if scheme.name == "xor" else {0, 3}
    got, _ = rebuild_set(pset, [None if i in lost else b for i, b in enumerate(bundles)],
                         [None if i in lost else d for i, (_, d) in enumerate(held)], held[0][0]["sizes"], codec)
    for i in lost:
        assert got[i].tobytes() == bundles[i].tobytes()
    kinds = [e["event"] for e in events.read(shared / "events")]
    assert kinds.count("snapshot_protected") == NODES


def test_partner_holds_an_exact_copy_of_its_neighbours_bundle(cluster):
    roots, shared, secret = cluster
    scheme = Scheme("partner", distance=1)
    done = _run_agents(roots, shared, secret, scheme, tag="partner")
    assert [p.returncode for p in done] == [0] * NODES, [p.stderr[-2000:] for p in done]
    placement = plan(NODES, scheme)
    bundles = [_bundle_bytes(root, 2) for root in roots]
    copies = [_held(root, 2)[1] for root in roots]
    for slot in range(NODES):
        assert copies[slot].tobytes() == bundles[placement.partnered_by(slot)].tobytes()
    got, _ = rebuild_partner(placement, [None, *bundles[1:]], [None, *copies[1:]])
    assert got[0].tobytes() == bundles[0].tobytes()


def test_a_corrupt_chunk_stops_protection_of_that_step_with_an_event(cluster):
    roots, shared, secret = cluster
    data = complete_steps(job_dir(roots[2], JOB))[2][4].data_path
    with open(data, "r+b") as fh:
        fh.seek(1000)
        byte = fh.read(1)
        fh.seek(1000)
        fh.write(bytes([byte[0] ^ 0xFF]))
    done = _run_agents(roots, shared, secret, Scheme("xor", group=4), tag="corrupt")
    assert [p.returncode for p in done] == [0] * NODES, [p.stderr[-2000:] for p in done]
    assert all("protected=None" in p.stdout for p in done)
    skipped = [e for e in events.read(shared / "events") if e["event"] == "protect_skipped"]
    assert len(skipped) == 1 and skipped[0]["slot"] == 2 and skipped[0]["step"] == 2
    assert all(2 not in records(job_dir(root, JOB)) for root in roots)
