"""What the tests of the protect pass with real agent processes share (test_agent_protect.py over TCP,
test_agent_protect_mpi.py over MPI): four "nodes" on this machine, each its own store root with two ranks' committed
steps 1 and 2, the agents started on them over either transport, and the checks of what each node then holds."""
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest

from hpcft import events, status
from hpcft.agent.transport import secret as job_secret
from hpcft.agent import status as agent_status
from hpcft.agent.protection.bundle import Bundle, complete_steps
from hpcft.agent.protection.codec import codec_for
from hpcft.agent.protection.placement import Scheme, plan
from hpcft.agent.protection.protect import records
from hpcft.agent.protection.stripes import encode_set, rebuild_partner, rebuild_set
from hpcft.agent.settings import AgentConfig
from hpcft.bench.transport import mpirun_argv
from hpcft.sandbox.config import OPEN_MPI_TCP_ENV
from hpcft.store import RankStore, chunk_table, job_dir, seal_key

JOB = "4242"
NODES = 4
RANKS_PER_NODE = 2
CHUNK = 64 << 10


class Cluster(NamedTuple):
    """The nodes' store roots, the rendezvous directory the agents share and the job secret in it."""

    roots: list[Path]
    shared: Path
    secret: Path


def data(rank: int, step: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(rank * 1000 + step).integers(0, 256, nbytes, dtype=np.uint8)


def commit_version(store: RankStore, step: int, nbytes: int) -> bytes:
    """Commit `step` of the store's rank (deterministic bytes) as a trainer would; the manifest's bytes."""
    slot = store.begin(nbytes)
    payload = data(store.rank, step, nbytes)
    slot.array[:nbytes] = payload
    store.commit(slot, {"step": step, "rank": store.rank, "data_bytes": nbytes, "chunk_bytes": CHUNK,
                        "chunks": chunk_table(payload, CHUNK, seal_key({"step": step}))})
    return (store.dir / f"slot-{slot.index}.json").read_bytes()


def size(rank: int) -> int:
    return 300_000 + 17_000 * rank


def make_cluster(base: Path) -> Cluster:
    """Four node roots under `base` with steps 1 and 2 committed by two ranks each (sizes differ per rank)."""
    roots = [base / f"node{i}" for i in range(NODES)]
    for i, root in enumerate(roots):
        root.mkdir(parents=True)
        for rank in range(i * RANKS_PER_NODE, (i + 1) * RANKS_PER_NODE):
            for step in (1, 2):
                store = RankStore(JOB, rank, root=root)
                try:
                    commit_version(store, step, size(rank))
                finally:
                    store.close()
    shared = base / "shared"
    shared.mkdir(mode=0o700)
    return Cluster(roots, shared, job_secret.create(shared))


def copy_cluster(cluster: Cluster, base: Path) -> Cluster:
    """The cluster as it is now (stores, protection records, rendezvous, events), copied under `base`: a test that
    goes on from a shared run changes only its own copy."""
    for path in (*cluster.roots, cluster.shared):
        shutil.copytree(path, base / path.name, symlinks=True)
    return Cluster([base / r.name for r in cluster.roots], base / cluster.shared.name,
                   base / cluster.shared.name / cluster.secret.name)


def agent_argv(i: int, cluster: Cluster, scheme: Scheme, tag: str, *flags: str, **settings) -> list[str]:
    """Node `i`'s agent: `flags` its own (--rebuild), `settings` AgentConfig fields beside the cluster's."""
    cfg = AgentConfig(str(cluster.shared), secret_file=str(cluster.secret), scheme=scheme, **settings)
    return [sys.executable, "-m", "hpcft.agent", "--settings", cfg.to_json(), "--job-id", JOB, "--slot", str(i),
            "--slots", str(NODES), "--tag", tag, *flags]


def agent_env(root: Path, shared: Path) -> dict[str, str]:
    return {"HPCFT_STORE_ROOT": str(root), "HPCFT_EVENT_DIR": str(shared / "events")}


def start_agents(cluster: Cluster, scheme: Scheme, tag: str, *flags: str, **settings) -> list[subprocess.Popen]:
    """One agent process per node over TCP, at once."""
    return [subprocess.Popen(agent_argv(i, cluster, scheme, tag, *flags, **settings), env={**os.environ,
                             **agent_env(root, cluster.shared)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for i, root in enumerate(cluster.roots)]


def start_mpi_agents(cluster: Cluster, scheme: Scheme, tag: str, *flags: str,
                     **settings) -> tuple[subprocess.Popen, Path]:
    """The agents as the four ranks of one mpirun (--transport mpi, Open MPI over TCP here), the slots in the reverse
    of the ranks' order; the mpirun and the directory of each agent's output and exit status."""
    if shutil.which("mpirun") is None:
        pytest.skip("no mpirun on this machine")
    logs = cluster.shared / f"mpi-{tag}"
    logs.mkdir()
    tasks = [(agent_argv(i, cluster, scheme, tag, *flags, transport="mpi", **settings),
              agent_env(cluster.roots[i], cluster.shared)) for i in reversed(range(NODES))]  # see `mpi_log`
    # as under srun, a rank that exits without MPI_Finalize (an agent stopped beside a frozen peer) does not make
    # mpirun kill the rest, which would cut their own clean stop short
    env = {**os.environ, **OPEN_MPI_TCP_ENV, "OMPI_MCA_orte_allowed_exit_without_sync": "1"}
    return subprocess.Popen(mpirun_argv(tasks, logs), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True), logs


def mpi_log(logs: Path, slot: int, kind: str) -> Path:
    """The agent of `slot`'s output (out, err) or exit status (rc): mpirun_argv names them by rank, and rank r runs
    slot NODES - 1 - r."""
    return logs / f"{NODES - 1 - slot}.{kind}"


def mpi_result(logs: Path, i: int) -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess([], int(mpi_log(logs, i, "rc").read_text() or 1),
                                       mpi_log(logs, i, "out").read_text(), mpi_log(logs, i, "err").read_text())


def _mpi_files(logs: Path) -> str:
    """What each rank of a failed mpirun left in `logs` (the tail of its out and err, its rc), for the message."""
    found = sorted(logs.iterdir()) if logs.is_dir() else []
    return "; ".join(f"{p.name}: {p.read_text(errors='replace')[-800:]!r}" for p in found) or "none"


def run_agents(cluster: Cluster, scheme: Scheme, tag: str, *flags: str, transport: str = "tcp",
               **settings) -> list[subprocess.CompletedProcess]:
    """The agents of every node run to their end over `transport`: each one's output and exit status."""
    if transport == "mpi":
        proc, logs = start_mpi_agents(cluster, scheme, tag, *flags, **settings)
        out, _ = proc.communicate(timeout=240)
        if not all(mpi_log(logs, i, "rc").exists() for i in range(NODES)):
            raise AssertionError(f"mpirun (exit {proc.returncode}) ran no agent to its end; its output: "
                                 f"{out[-3000:]!r}; the agents' files: {_mpi_files(logs)}")
        return [mpi_result(logs, i) for i in range(NODES)]
    procs = start_agents(cluster, scheme, tag, *flags, **settings)
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


def check(done: list[subprocess.CompletedProcess], code: int = 0) -> None:
    """Every agent exited with `code`; else their stderr tails."""
    assert [p.returncode for p in done] == [code] * NODES, [p.stderr[-2000:] for p in done]


def bundle_bytes(root: Path, step: int) -> np.ndarray:
    b = Bundle(step, complete_steps(job_dir(root, JOB))[step])
    return np.concatenate(b.piece(0, b.size))


def held(root: Path, step: int) -> tuple[dict, np.ndarray]:
    """A node's protection record of `step`: its meta and its bytes."""
    rec = records(job_dir(root, JOB))[step]
    return rec.meta, np.fromfile(rec.path.with_suffix(".data"), dtype=np.uint8)[:rec.meta["bytes"]]


def node_files(root: Path) -> dict[str, bytes]:
    """What a node holds of the job: every committed manifest and the data it describes, byte for byte."""
    out = {}
    for h in (h for by_rank in complete_steps(job_dir(root, JOB)).values() for h in by_rank.values()):
        out[str(h.manifest_path.relative_to(root))] = h.manifest_bytes
        out[str(h.data_path.relative_to(root))] = h.data_path.read_bytes()[:h.manifest["data_bytes"]]
    return out


def replace(cluster: Cluster, lost: set[int], base: Path) -> Cluster:
    """Crash nodes `lost` (their memory is gone) and give their slots to empty spare nodes under `base`."""
    now = list(cluster.roots)
    for i in lost:
        now[i] = base / f"spare{i}"
        now[i].mkdir()
    return cluster._replace(roots=now)


def check_parity(cluster: Cluster, scheme: Scheme, done: list[subprocess.CompletedProcess]) -> None:
    """After a protect run (tag scheme.name) of an xor or rs scheme: every node holds exactly its share of the parity
    of step 2, which rebuilds lost nodes' bundles, said in events and in `hpcft status`'s view."""
    check(done)
    assert all("protected=2" in p.stdout for p in done)
    pset = plan(NODES, scheme).sets[0]
    codec = codec_for(scheme.name, pset.size, pset.losses)
    bundles = [bundle_bytes(root, 2) for root in cluster.roots]
    expected = encode_set(pset, bundles, codec)
    kept = [held(root, 2) for root in cluster.roots]
    for (meta, got), want in zip(kept, expected):
        assert got.tobytes() == want.tobytes()
        assert meta["sizes"] == [b.size for b in bundles]
    lost = {1} if scheme.name == "xor" else {0, 3}
    got, _ = rebuild_set(pset, [None if i in lost else b for i, b in enumerate(bundles)],
                         [None if i in lost else d for i, (_, d) in enumerate(kept)], kept[0][0]["sizes"], codec)
    for i in lost:
        assert got[i].tobytes() == bundles[i].tobytes()
    kinds = [e["event"] for e in events.read(cluster.shared / "events")]
    assert kinds.count("snapshot_protected") == NODES
    view = status.collect(cluster.shared, tag=scheme.name)  # what `hpcft status` shows from the agents' status files
    assert [(n.fresh, n.steps, sorted(n.ranks)) for n in view.nodes] == [
        (True, {"1": status.STAGED, "2": status.PROTECTED}, [str(2 * i), str(2 * i + 1)]) for i in range(NODES)]
    assert [(s.health, s.protected_step) for s in view.sets] == [(status.HEALTHY, 2)]


def check_partner(cluster: Cluster, tag: str, done: list[subprocess.CompletedProcess]) -> None:
    """After a partner protect run (`tag`, --lag-bound 1): each node holds an exact copy of its neighbour's bundle,
    which rebuilds it, and the agents kept to the bound."""
    check(done)
    reports = agent_status.read(cluster.shared, tag).values()
    assert [(r["lag_steps"], r["cpu_cores"] > 0) for r in reports] == [(0, True)] * NODES, reports
    placement = plan(NODES, Scheme("partner", distance=1))
    bundles = [bundle_bytes(root, 2) for root in cluster.roots]
    copies = [held(root, 2)[1] for root in cluster.roots]
    for slot in range(NODES):
        assert copies[slot].tobytes() == bundles[placement.partnered_by(slot)].tobytes()
    got, _ = rebuild_partner(placement, [None, *bundles[1:]], [None, *copies[1:]])
    assert got[0].tobytes() == bundles[0].tobytes()


def check_rebuild(protected: Cluster, scheme: Scheme, lost: set[int], base: Path, transport: str = "tcp") -> None:
    """From a cluster whose step 2 is protected: nodes `lost` replaced by empty ones under `base`, the agents'
    rebuild (tag r) puts each one's snapshot and protection record back byte-identical."""
    before = {i: node_files(protected.roots[i]) for i in lost}
    want_records = {i: held(protected.roots[i], 2)[1].tobytes() for i in lost}
    now = replace(protected, lost, base)
    done = run_agents(now, scheme, "r", "--rebuild", transport=transport)
    check(done)
    assert all("rebuilt=2" in p.stdout for p in done)
    for i in lost:
        got = node_files(now.roots[i])
        step2 = {k: v for k, v in before[i].items() if k in got}
        assert got.keys() == {k for k in before[i] if k in step2} and len(got) == 2 * RANKS_PER_NODE
        assert got == step2  # manifests and data of step 2, byte-identical
        assert held(now.roots[i], 2)[1].tobytes() == want_records[i]  # its own protection record regenerated
    kinds = [e["event"] for e in events.read(now.shared / "events")]
    assert kinds.count("rebuild_done") == NODES
