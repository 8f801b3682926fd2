"""`hpcft bench protect`: the cost of cross-node protection, one record per scheme (xor, partner, rs).

On this machine four "nodes" are four store roots, each with one rank's committed snapshot of the state
size, and four real agent processes meshed over TCP. Per scheme: encode throughput against a memcpy of
the same bytes (interleaved), bytes each node sent and stores over its state (against the scheme's
formula), the time to rebuild one node onto an empty spare, and the training-step time of a CPU model
with hpcft snapshots every step while the agents protect continuously, next to the same with the agents
stopped (SIGSTOP). Caveat: the four agents share this machine's cores with the trainer; on a cluster each
node runs one agent, so the overhead measured here is about four nodes' worth.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpcft import events
from hpcft.agent import secret as job_secret
from hpcft.agent.bundle import Bundle, complete_steps
from hpcft.agent.codec import codec_for
from hpcft.agent.placement import Scheme, plan
from hpcft.agent.protect import records
from hpcft.agent.stripes import encode_set, partner_copies
from hpcft.bench.harness import Memcpy, Report, Variant, run_interleaved, scratch, set_threads
from hpcft.errors import HpcftError
from hpcft.store import RankStore, crc32c, job_dir

NODES = 4
JOB = "bench-protect"
CHUNK = 4 << 20
SCHEMES = (Scheme("xor", group=4), Scheme("partner", distance=1), Scheme("rs", group=4, losses=2))


@dataclass(frozen=True)
class ProtectOptions:
    params: int
    state_bytes: int
    steps: int
    warmup: int
    threads: int
    interval: float
    root: str | None = None


def _commit(root: Path, rank: int, step: int, data: np.ndarray) -> None:
    store = RankStore(JOB, rank, root=root)
    try:
        slot = store.begin(data.size)
        slot.array[:data.size] = data
        chunks = [[lo, min(CHUNK, data.size - lo), crc32c(data[lo:lo + CHUNK])] for lo in range(0, data.size, CHUNK)]
        store.commit(slot, {"step": step, "rank": rank, "data_bytes": int(data.size), "chunks": chunks})
    finally:
        store.close()


def _agents(roots: list[Path], shared: Path, scheme: Scheme, tag: str, *extra: str) -> list[subprocess.Popen]:
    procs = []
    for i, root in enumerate(roots):
        env = {**os.environ, "HPCFT_STORE_ROOT": str(root), "HPCFT_EVENT_DIR": str(shared / "events")}
        argv = [sys.executable, "-m", "hpcft.agent", "--job-id", JOB, "--slot", str(i), "--slots", str(NODES),
                "--rendezvous", str(shared), "--secret", str(shared / "secret"), "--scheme", scheme.name,
                "--group", str(scheme.group), "--losses", str(scheme.losses), "--distance", str(scheme.distance),
                "--tag", tag, *extra]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    return procs


def _finish(procs: list[subprocess.Popen], what: str) -> None:
    errors = []
    for p in procs:
        _, err = p.communicate(timeout=600)
        if p.returncode:
            errors.append(err[-1500:])
    if errors:
        raise HpcftError(f"{what}: agents failed:\n" + "\n".join(errors))


class Encode(Variant):
    """The encode work of one protect pass of the whole set (every holder's parity, or every partner copy)."""

    name, label = "encode", "encode"

    def __init__(self, scheme: Scheme, payloads: list[np.ndarray]) -> None:
        self.scheme, self.payloads = scheme, payloads
        self.placement = plan(NODES, scheme)

    def run_once(self, index: int) -> None:
        if self.scheme.name == "partner":
            partner_copies(self.placement, self.payloads)
        else:
            pset = self.placement.sets[0]
            encode_set(pset, self.payloads, codec_for(self.scheme.name, pset.size, pset.losses))


class Train(Variant):
    """A training step plus an hpcft snapshot; the agents run (`protect=True`) or are stopped."""

    def __init__(self, name: str, trainer, ckpt, agents: list[subprocess.Popen], protect: bool) -> None:
        self.name = self.label = name
        self.trainer, self.ckpt, self.agents, self.protect = trainer, ckpt, agents, protect

    def prepare(self, index: int) -> None:
        for p in self.agents:
            os.kill(p.pid, signal.SIGCONT if self.protect else signal.SIGSTOP)

    def run_once(self, index: int) -> None:
        self.trainer.step()
        self.ckpt.step(self.trainer.steps_done)

    def drain(self) -> None:
        self.ckpt.wait()


def _overhead(opts: ProtectOptions, scheme: Scheme, base: Path) -> tuple[float, int]:
    """Median step time with protection running over the same without, minus 1; and steps protected."""
    from hpcft.bench.model import Trainer, config_for_params
    from hpcft.checkpointer import Checkpointer

    roots = [base / f"train{i}" for i in range(NODES)]
    shared = base / "train-shared"
    for r in roots:
        r.mkdir()
    shared.mkdir(mode=0o700)
    job_secret.create(shared)
    trainer = Trainer(config_for_params(opts.params))
    trainer.step()
    ckpt = Checkpointer(trainer.model, trainer.optimizer, every=1, keep=2, root=str(roots[0]), job_id=JOB, auto=False)
    agents: list[subprocess.Popen] = []
    try:
        ckpt.step(trainer.steps_done)
        ckpt.wait()
        rank_dir = next(job_dir(roots[0], JOB).glob("rank-*"))
        for r in roots[1:]:  # every node's agent protects this trainer's snapshots as its own
            j = job_dir(r, JOB)
            j.mkdir(mode=0o700)
            (j / rank_dir.name).symlink_to(rank_dir)
        agents = _agents(roots, shared, scheme, "train", "--rounds", "0", "--interval", str(opts.interval))
        with_p, without = Train("with_protection", trainer, ckpt, agents, True), Train("without", trainer, ckpt, agents, False)
        timings = run_interleaved([without, with_p], opts.steps, opts.warmup, block=2)
        for p in agents:
            os.kill(p.pid, signal.SIGCONT)
        protected = sum(1 for e in events.read(shared / "events") if e["event"] == "snapshot_protected")
        return timings.median("with_protection") / timings.median("without") - 1.0, protected
    finally:
        for p in agents:
            p.kill()
            p.wait()
        ckpt.close()


def _scheme_record(opts: ProtectOptions, scheme: Scheme, base: Path) -> dict:
    roots = [base / f"node{i}" for i in range(NODES)]
    shared = base / "shared"
    rng = np.random.default_rng(0)
    for i, r in enumerate(roots):
        r.mkdir()
        _commit(r, i, 1, rng.integers(0, 256, opts.state_bytes, dtype=np.uint8))
    shared.mkdir(mode=0o700)
    job_secret.create(shared)
    bundles = [Bundle(1, complete_steps(job_dir(r, JOB))[1]) for r in roots]
    payloads = [np.concatenate(b.piece(0, b.size)) for b in bundles]
    state = float(np.mean([b.size for b in bundles]))
    enc, ref = Encode(scheme, payloads), Memcpy(sum(p.size for p in payloads))
    timings = run_interleaved([enc, ref], steps=3, warmup=1, block=1)
    ref.close()

    _finish(_agents(roots, shared, scheme, "p"), "protect pass")
    metas = [records(job_dir(r, JOB))[1].meta for r in roots]
    spare = base / "spare1"
    spare.mkdir()
    _finish(_agents([roots[0], spare, *roots[2:]], shared, scheme, "r", "--rebuild"), "rebuild")
    done = [e for e in events.read(shared / "events") if e["event"] == "rebuild_done" and e.get("here")]
    overhead, protected = _overhead(opts, scheme, base)
    return {
        "scheme": scheme.name, "group": scheme.group if scheme.name != "partner" else 2,
        "losses": scheme.tolerated, "state_bytes": int(state),
        "encode_gbps": sum(p.size for p in payloads) / timings.median("encode") / 1e9,
        "encode_vs_memcpy": timings.median("memcpy") / timings.median("encode"),
        "sent_per_node_over_state": float(np.mean([m["sent_bytes"] for m in metas])) / state,
        "stored_per_node_over_state": float(np.mean([m["bytes"] for m in metas])) / state,
        "expected_over_state": scheme.stored_over_state(),
        "expected_sent_over_state": {"partner": 1.0, "xor": 1.0}.get(scheme.name, float(scheme.losses)),
        "rebuild_s": done[0]["seconds"] if done else None,
        "overhead_with_protection": overhead,
        "protect_passes_during_training": protected,
    }


def run(opts: ProtectOptions) -> Report:
    """Run the protect bench over every scheme and return its report."""
    set_threads(opts.threads)
    report = Report("protect")
    out = []
    for scheme in SCHEMES:
        with scratch(opts.root) as where:
            rec = _scheme_record(opts, scheme, where.shm)
        out.append(rec)
        s = scheme.name
        report.add(f"{s}_encode_vs_memcpy", rec["encode_vs_memcpy"], "x", f"{s}: encode ÷ memcpy bandwidth")
        report.add(f"{s}_stored_per_node_over_state", rec["stored_per_node_over_state"], "x",
                   f"{s}: stored per node ÷ state (formula {rec['expected_over_state']:.3f})")
        report.add(f"{s}_sent_per_node_over_state", rec["sent_per_node_over_state"], "x", f"{s}: sent per node ÷ state")
        report.add(f"{s}_rebuild_s", rec["rebuild_s"], "s", f"{s}: rebuild of one node")
        report.add(f"{s}_overhead_with_protection", rec["overhead_with_protection"], "%",
                   f"{s}: step time, protection running vs stopped")
    report.note("schemes", out)
    report.note("config", {"nodes": NODES, "state_bytes": opts.state_bytes, "params": opts.params, "steps": opts.steps,
                           "interval_s": opts.interval, "threads": opts.threads})
    return report
