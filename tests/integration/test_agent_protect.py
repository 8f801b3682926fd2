"""The protect pass with real agent processes on this machine: four "nodes" (each its own store root,
two ranks each), agents meshed over authenticated TCP (or, where parametrized, over MPI under mpirun). What each node
keeps must be byte-identical to the parity (or partner copy) of the nodes' bundles, and must rebuild a lost node's
bundle exactly."""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from hpcft import events, status
from hpcft.agent import secret as job_secret
from hpcft.agent import status as agent_status
from hpcft.agent.bundle import Bundle, complete_steps, local_versions
from hpcft.agent.codec import codec_for
from hpcft.agent.placement import Scheme, plan
from hpcft.agent.protect import records
from hpcft.agent.stripes import encode_set, rebuild_partner, rebuild_set
from hpcft.bench.transport import mpirun_argv
from hpcft.deps import available
from hpcft.errors import NoCheckpointError
from hpcft.sandbox.config import OPEN_MPI_TCP_ENV
from hpcft.store import RankStore, chunk_table, job_dir, seal_key
from hpcft.store import pin as store_pin

JOB = "4242"
NODES = 4
RANKS_PER_NODE = 2
CHUNK = 64 << 10


def _data(rank: int, step: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(rank * 1000 + step).integers(0, 256, nbytes, dtype=np.uint8)


def _commit_version(store: RankStore, step: int, nbytes: int) -> bytes:
    """Commit `step` of the store's rank (deterministic bytes) as a trainer would; the manifest's bytes."""
    slot = store.begin(nbytes)
    data = _data(store.rank, step, nbytes)
    slot.array[:nbytes] = data
    store.commit(slot, {"step": step, "rank": store.rank, "data_bytes": nbytes, "chunk_bytes": CHUNK,
                        "chunks": chunk_table(data, CHUNK, seal_key({"step": step}))})
    return (store.dir / f"slot-{slot.index}.json").read_bytes()


def _size(rank: int) -> int:
    return 300_000 + 17_000 * rank


def _write_version(root: Path, rank: int, step: int, nbytes: int) -> None:
    store = RankStore(JOB, rank, root=root)
    try:
        _commit_version(store, step, nbytes)
    finally:
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
                _write_version(root, rank, step, _size(rank))
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    return roots, shared, job_secret.create(shared)


def _agent_argv(i: int, shared, secret, scheme: Scheme, tag: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "hpcft.agent", "--job-id", JOB, "--slot", str(i), "--slots", str(NODES),
            "--rendezvous", str(shared), "--secret", str(secret), "--scheme", scheme.name,
            "--group", str(scheme.group), "--losses", str(scheme.losses), "--distance", str(scheme.distance),
            "--tag", tag, *extra]


def _agent_env(root: Path, shared: Path) -> dict[str, str]:
    return {"HPCFT_STORE_ROOT": str(root), "HPCFT_EVENT_DIR": str(shared / "events")}


def _start_agents(roots, shared, secret, scheme: Scheme, tag: str, *extra: str) -> list[subprocess.Popen]:
    return [subprocess.Popen(_agent_argv(i, shared, secret, scheme, tag, *extra), env={**os.environ,
                             **_agent_env(root, shared)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i, root in enumerate(roots)]


def _start_mpi_agents(roots, shared, secret, scheme: Scheme, tag: str, *extra: str) -> tuple[subprocess.Popen, Path]:
    """The agents as the four ranks of one mpirun (--transport mpi, Open MPI over TCP here), the slots in the reverse
    of the ranks' order; the mpirun and the directory of each agent's output and exit status."""
    if shutil.which("mpirun") is None:
        pytest.skip("no mpirun on this machine")
    logs = shared / f"mpi-{tag}"
    logs.mkdir()
    tasks = [(_agent_argv(i, shared, secret, scheme, tag, "--transport", "mpi", *extra), _agent_env(roots[i], shared))
             for i in reversed(range(len(roots)))]  # rank r runs slot NODES - 1 - r: see `_log`
    argv = mpirun_argv(tasks, logs)
    return subprocess.Popen(argv, env={**os.environ, **OPEN_MPI_TCP_ENV}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True), logs


def _log(logs: Path, slot: int, kind: str) -> Path:
    """The agent of `slot`'s output (out, err) or exit status (rc): mpirun_argv names them by rank."""
    return logs / f"{NODES - 1 - slot}.{kind}"


def _mpi_result(logs: Path, i: int) -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess([], int(_log(logs, i, "rc").read_text() or 1), _log(logs, i, "out").read_text(),
                                       _log(logs, i, "err").read_text())


def _run_mpi_agents(roots, shared, secret, scheme: Scheme, tag: str, *extra: str) -> list[subprocess.CompletedProcess]:
    """`_start_mpi_agents` run to its end: each agent's output and exit status, as `_run_agents`."""
    proc, logs = _start_mpi_agents(roots, shared, secret, scheme, tag, *extra)
    out, _ = proc.communicate(timeout=240)
    if not all(_log(logs, i, "rc").exists() for i in range(len(roots))):
        raise AssertionError(f"mpirun ran no agent to its end: {out[-3000:]}")
    return [_mpi_result(logs, i) for i in range(len(roots))]


def _run_agents(roots, shared, secret, scheme: Scheme, tag: str, *extra: str,
                transport: str = "tcp") -> list[subprocess.CompletedProcess]:
    if transport == "mpi":
        return _run_mpi_agents(roots, shared, secret, scheme, tag, *extra)
    procs = _start_agents(roots, shared, secret, scheme, tag, *extra)
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=120)
            out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def _bundle_bytes(root: Path, step: int) -> np.ndarray:
    b = Bundle(step, complete_steps(job_dir(root, JOB))[step])
    return np.concatenate(b.piece(0, b.size))


def _held(root: Path, step: int) -> tuple[dict, np.ndarray]:
    rec = records(job_dir(root, JOB))[step]
    data = np.fromfile(rec.path.with_suffix(".data"), dtype=np.uint8)[:rec.meta["bytes"]]
    return rec.meta, data


# the protection tests over either transport: TCP, and MPI (mpi4py on this machine's Open MPI, under mpirun)
TRANSPORTS = pytest.mark.parametrize("transport", ["tcp", pytest.param("mpi", marks=pytest.mark.skipif(
    not available("mpi4py"), reason="mpi4py is not installed"))])


@pytest.mark.parametrize("scheme", [Scheme("xor", group=4), Scheme("rs", group=4, losses=2)], ids=["xor", "rs"])
@TRANSPORTS
def test_parity_on_every_node_is_exact_and_rebuilds_lost_nodes(cluster, scheme, transport):
    roots, shared, secret = cluster
    done = _run_agents(roots, shared, secret, scheme, scheme.name, transport=transport)
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
    view = status.collect(shared, tag=scheme.name)  # what `hpcft status` shows from the agents' status files
    assert [(n.fresh, n.steps, sorted(n.ranks)) for n in view.nodes] == [
        (True, {"1": status.STAGED, "2": status.PROTECTED}, [str(2 * i), str(2 * i + 1)]) for i in range(NODES)]
    assert [(s.health, s.protected_step) for s in view.sets] == [(status.HEALTHY, 2)]


@TRANSPORTS
def test_partner_holds_an_exact_copy_of_its_neighbours_bundle(cluster, transport):
    roots, shared, secret = cluster
    scheme = Scheme("partner", distance=1)
    done = _run_agents(roots, shared, secret, scheme, "partner", "--lag-bound", "1",  # kept to: the cap stays
                       transport=transport)
    assert [p.returncode for p in done] == [0] * NODES, [p.stderr[-2000:] for p in done]
    reports = agent_status.read(shared, "partner").values()
    assert [(r["lag_steps"], r["cpu_cores"] > 0) for r in reports] == [(0, True)] * NODES, reports
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


# -- rebuild onto replacement nodes ---------------------------------------------------------------------

def _node_files(root: Path) -> dict[str, bytes]:
    """What a node holds of the job: every committed manifest and the data it describes, byte for byte."""
    out = {}
    for held in (h for by_rank in complete_steps(job_dir(root, JOB)).values() for h in by_rank.values()):
        out[str(held.manifest_path.relative_to(root))] = held.manifest_bytes
        out[str(held.data_path.relative_to(root))] = held.data_path.read_bytes()[:held.manifest["data_bytes"]]
    return out


def _replace(roots: list[Path], lost: set[int], tmp_path: Path) -> list[Path]:
    """Crash nodes `lost` (their memory is gone) and give their slots to empty spare nodes."""
    now = list(roots)
    for i in lost:
        now[i] = tmp_path / f"spare{i}"
        now[i].mkdir()
    return now


def _check(done):
    assert [p.returncode for p in done] == [0] * NODES, [p.stderr[-2000:] for p in done]


@pytest.mark.parametrize("scheme,lost", [(Scheme("xor", group=4), {1}), (Scheme("partner", distance=1), {2}),
                                         (Scheme("rs", group=4, losses=2), {0, 3})], ids=["xor", "partner", "rs"])
@TRANSPORTS
def test_rebuild_puts_the_lost_nodes_snapshot_back_byte_identical(cluster, tmp_path, scheme, lost, transport):
    roots, shared, secret = cluster
    _check(_run_agents(roots, shared, secret, scheme, "p", transport=transport))
    before = {i: _node_files(roots[i]) for i in lost}
    want_records = {i: _held(roots[i], 2)[1].tobytes() for i in lost}
    now = _replace(roots, lost, tmp_path)
    done = _run_agents(now, shared, secret, scheme, "r", "--rebuild", transport=transport)
    assert [p.returncode for p in done] == [0] * NODES, [p.stderr[-2000:] for p in done]
    assert all("rebuilt=2" in p.stdout for p in done)
    for i in lost:
        got = _node_files(now[i])
        step2 = {k: v for k, v in before[i].items() if k in got}
        assert got.keys() == {k for k in before[i] if k in step2} and len(got) == 2 * RANKS_PER_NODE
        assert got == step2  # manifests and data of step 2, byte-identical
        assert _held(now[i], 2)[1].tobytes() == want_records[i]  # its own protection record regenerated
    kinds = [e["event"] for e in events.read(shared / "events")]
    assert kinds.count("rebuild_done") == NODES


def test_two_nodes_of_one_xor_set_lost_is_no_checkpoint_and_writes_nothing(cluster, tmp_path):
    roots, shared, secret = cluster
    scheme = Scheme("xor", group=4)
    _check(_run_agents(roots, shared, secret, scheme, "p", "--rounds", "2"))
    now = _replace(roots, {1, 2}, tmp_path)
    done = _run_agents(now, shared, secret, scheme, "r", "--rebuild")
    assert [p.returncode for p in done] == [3] * NODES, [p.stderr[-2000:] for p in done]
    for i in (1, 2):
        assert not list(now[i].rglob("*.json")), "a node that could not be rebuilt must hold no partial version"
    failed = [e for e in events.read(shared / "events") if e["event"] == "rebuild_failed"]
    assert len(failed) == NODES and "persistent tier" in failed[0]["reason"]
    states = agent_status.read(shared, "r")
    assert {s["phase"] for s in states.values()} == {"failed"}
    with pytest.raises(NoCheckpointError):
        agent_status.wait_ready(shared, "r", NODES, timeout=5)


def test_a_corrupt_parity_chunk_is_detected_and_an_older_step_is_rebuilt(cluster, tmp_path):
    roots, shared, secret = cluster
    scheme = Scheme("xor", group=4)
    _check(_run_agents(roots, shared, secret, scheme, "p", "--rounds", "2"))
    assert sorted(records(job_dir(roots[2], JOB))) == [1, 2]
    step1 = _node_files(roots[1])
    parity = records(job_dir(roots[2], JOB))[2].path.with_suffix(".data")
    with open(parity, "r+b") as fh:
        fh.seek(5)
        b = fh.read(1)
        fh.seek(5)
        fh.write(bytes([b[0] ^ 1]))
    now = _replace(roots, {1}, tmp_path)
    _check(_run_agents(now, shared, secret, scheme, "r", "--rebuild"))
    got = _node_files(now[1])
    assert got and got == {k: v for k, v in step1.items() if k in got}
    assert {json.loads(v)["step"] for k, v in got.items() if k.endswith(".json")} == {1}
    kinds = [e["event"] for e in events.read(shared / "events")]
    assert "protect_chunk_lost" in kinds and "rebuild_fallback" in kinds
    assert agent_status.wait_ready(shared, "r", NODES, timeout=5).step == 1


def test_an_agent_killed_mid_protection_loses_nothing_and_the_relaunch_completes(cluster):
    roots, shared, secret = cluster
    scheme = Scheme("xor", group=4)
    procs = _start_agents(roots, shared, secret, scheme, "k", "--rate", "400000")  # ~2 s per pass
    deadline = time.monotonic() + 60
    while not (job_dir(roots[1], JOB) / "protect" / "step-2.data").exists():
        assert time.monotonic() < deadline, "the protect pass never started"
        time.sleep(0.02)
    procs[1].send_signal(signal.SIGKILL)
    for p in procs:
        p.wait(timeout=60)
    assert all(2 not in records(job_dir(root, JOB)) for root in roots), "the kill came after the pass"
    _check(_run_agents(roots, shared, secret, scheme, "k2"))
    pset = plan(NODES, scheme).sets[0]
    expected = encode_set(pset, [_bundle_bytes(root, 2) for root in roots], codec_for("xor", pset.size, 1))
    for root, want in zip(roots, expected):
        assert _held(root, 2)[1].tobytes() == want.tobytes()
        assert [p.name for p in (job_dir(root, JOB) / "protect").glob("*.data")] == ["step-2.data"]


@pytest.mark.skipif(not available("mpi4py"), reason="mpi4py is not installed")
def test_over_mpi_a_stop_ends_agents_blocked_on_a_frozen_peer(cluster):
    """No heartbeats (--loss-timeout 0): a frozen agent leaves its peers waiting on MPI messages that never come, yet
    the supervisor's stop ends them at once (no thread of theirs sits inside a blocking MPI call)."""
    roots, shared, secret = cluster
    proc, logs = _start_mpi_agents(roots, shared, secret, Scheme("xor", group=4), "f", "--rounds", "0",
                                   "--interval", "0.1", "--loss-timeout", "0")
    frozen = None
    try:
        deadline = time.monotonic() + 120
        while True:
            reports = agent_status.read(shared, "f")
            if len(reports) == NODES and all(r.get("protected") == 2 for r in reports.values()):
                break
            assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read() if proc.poll() else reports
            time.sleep(0.1)
        frozen = reports[2]["pid"]
        os.kill(frozen, signal.SIGSTOP)
        time.sleep(2.0)  # the others' next rounds now wait on slot 2
        assert all(agent_status.read(shared, "f")[i]["phase"] == agent_status.PROTECTING for i in (0, 1, 3))
        asked = time.monotonic()
        agent_status.request_stop(shared, "f")
        # each one's end: its mesh closed (no MPI_Finalize: the frozen one never gets there). Its exit status is
        # mpirun's to decide from then on: it kills the rest of a job in which a rank exits without MPI_Finalize
        # (srun does not), so the test reads the agents' own records
        while not all("event=mesh_mpi_closed" in _log(logs, i, "err").read_text() for i in (0, 1, 3)):
            assert time.monotonic() < asked + 60, "the stop did not end the agents waiting on the frozen one"
            time.sleep(0.1)
        assert [agent_status.read(shared, "f")[i]["phase"] for i in (0, 1, 3)] == [agent_status.STOPPED] * 3
        assert all(_mpi_result(logs, i).returncode == 0 for i in (0, 1, 3) if _log(logs, i, "rc").exists())
    finally:
        if frozen is not None:
            try:
                os.kill(frozen, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.kill()
        proc.wait()


# -- pins: a slow pass is never overtaken by trainers snapshotting every step -------------------------------

def test_a_slow_agent_protects_a_consistent_step_while_trainers_snapshot_every_step(cluster, tmp_path):
    roots, shared, secret = cluster
    scheme = Scheme("xor", group=4)
    procs = _start_agents(roots, shared, secret, scheme, "slow", "--rounds", "0", "--interval", "0.1",
                          "--rate", "300000")  # ~5 s a pass: the trainers commit ~50 steps meanwhile
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
                    manifests[(store.rank, step)] = _commit_version(store, step, _size(store.rank))
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
            _data(r, step, _size(r)).tofile(rdir / "slot-0.data")
            for f in rdir.iterdir():
                f.chmod(0o600)  # as the store writes them: the agent reads no store file open to others
        b = Bundle(step, complete_steps(job)[step])
        bundles.append(np.concatenate(b.piece(0, b.size)))
    pset = plan(NODES, scheme).sets[0]
    expected = encode_set(pset, bundles, codec_for("xor", pset.size, 1))
    for root, want in zip(roots, expected):
        assert _held(root, step)[1].tobytes() == want.tobytes()


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
