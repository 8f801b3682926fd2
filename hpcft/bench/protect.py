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
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpcft import events
from hpcft.agent.transport import secret as job_secret
from hpcft.agent.protection import budget
from hpcft.agent.protection.bundle import Bundle, complete_steps
from hpcft.agent.protection.codec import codec_for
from hpcft.agent.protection.placement import Scheme, plan
from hpcft.agent.protection.protect import records
from hpcft.agent.protection.stripes import encode_set, parity_bytes, partner_copies, piece_bytes
from hpcft.agent.settings import AgentConfig
from hpcft.agent.transport.throttle import CPU_SHARE, cpu_cores
from hpcft.bench.harness import Memcpy, Report, Variant, run_interleaved, scratch, set_threads
from hpcft.errors import HpcftError
from hpcft.options import Options
from hpcft.store import RankStore, chunk_table, job_dir, seal_key, secure_dir
from hpcft.store import pin as store_pin
from hpcft.store.paths import ranks

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
    interval: float | None = None  # seconds between agent rounds; None: the measured step time (a snapshot a step)
    rate: float | None = None      # agents' bytes/s cap; None or 0: none (the agent's default)
    cpu_share: float = CPU_SHARE   # agents' CPU cap, a fraction of this machine's cores (the agent's default)
    cpu_cores: float | None = None # agents' CPU cap in cores instead (what `hpcft run` gives them for CPU trainers)
    nice: int = 10                 # the agent's default: below the trainers
    lag_bound: int | None = None   # steps protection may trail before the cap rises (`hpcft run --protect-lag`)
    window: float = 60.0           # seconds of training with the agents running freely, after the timed steps
    schemes: tuple[str, ...] = ()  # names from SCHEMES; empty: all
    root: str | None = None


def _commit(root: Path, rank: int, step: int, data: np.ndarray) -> None:
    store = RankStore(JOB, rank, root=root)
    try:
        slot = store.begin(data.size)
        slot.array[:data.size] = data
        store.commit(slot, {"step": step, "rank": rank, "data_bytes": int(data.size),
                            "chunks": chunk_table(data, CHUNK, seal_key({"step": step}))})
    finally:
        store.close()


def _agents(roots: list[Path], shared: Path, scheme: Scheme, tag: str, *flags: str,
            **settings) -> list[subprocess.Popen]:
    """One agent per node root; `flags` the node's own (--rebuild), `settings` AgentConfig fields."""
    procs, cfg = [], AgentConfig(str(shared), secret_file=str(shared / "secret"), scheme=scheme, **settings)
    for i, root in enumerate(roots):
        env = {**os.environ, "HPCFT_STORE_ROOT": str(root), "HPCFT_EVENT_DIR": str(shared / "events")}
        argv = [sys.executable, "-m", "hpcft.agent", "--settings", cfg.to_json(), "--job-id", JOB, "--slot", str(i),
                "--slots", str(NODES), "--tag", tag, *flags]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    return procs


def _finish(procs: list[subprocess.Popen], what: str) -> None:
    errors = [err[-1500:] for p in procs for _, err in [p.communicate(timeout=600)] if p.returncode]
    if errors:
        raise HpcftError(f"{what}: agents failed:\n" + "\n".join(errors))


class Encode(Variant):
    """The encode work of one protect pass of the whole set (every holder's parity, or every partner copy), into
    preallocated, pre-faulted buffers as the agent's record files are (no page faults, no allocation)."""

    name, label = "encode", "encode"

    def __init__(self, scheme: Scheme, payloads: list[np.ndarray]) -> None:
        self.scheme, self.payloads = scheme, payloads
        self.placement = plan(NODES, scheme)
        if scheme.name == "partner":
            self.out = [np.ones(max(p.size for p in payloads), dtype=np.uint8) for _ in payloads]
        else:
            pset = self.placement.sets[0]
            self.codec = codec_for(scheme.name, pset.size, pset.losses)
            nbytes = piece_bytes(max(p.size for p in payloads), pset)
            self.out = [np.ones(parity_bytes(pset, pos, nbytes), dtype=np.uint8) for pos in range(pset.size)]

    def run_once(self, index: int) -> None:
        if self.scheme.name == "partner":
            partner_copies(self.placement, self.payloads, self.out)
        else:
            encode_set(self.placement.sets[0], self.payloads, self.codec, self.out)


class Train(Variant):
    """A training step plus an hpcft snapshot; the agents run (`protect=True`) or are stopped. Records when each
    step's snapshot was committed (wall time), to tell how far protection lags behind."""

    def __init__(self, name: str, trainer, ckpt, agents: list[subprocess.Popen], protect: bool,
                 committed: dict[int, float] | None = None) -> None:
        self.name = self.label = name
        self.trainer, self.ckpt, self.agents, self.protect = trainer, ckpt, agents, protect
        self.committed = {} if committed is None else committed

    def prepare(self, index: int) -> None:
        for p in self.agents:
            os.kill(p.pid, signal.SIGCONT if self.protect else signal.SIGSTOP)

    def run_once(self, index: int) -> None:
        self.trainer.step()
        self.ckpt.step(self.trainer.steps_done)

    def drain(self) -> None:
        self.ckpt.wait()
        self.committed[self.ckpt.completed] = time.time()


@dataclass(frozen=True)
class Overhead:
    """What one node's protection cost its trainer, and what protection it bought (see `_overhead`)."""
    overhead: float
    mean_overhead: float
    all_agents: float
    all_agents_mean: float
    node_share: float
    core_share: float
    agent_over_trainer: float | None
    cpu_overhead: float
    step_s: float
    step_cpu_s: float
    rate: float | None
    cpu_share: float | None
    cpu_cores: float
    interval: float
    protect_s: float | None
    agent_cpu_s: float | None
    peer_cpu_s: float | None
    protected: int
    snapshots: int
    stale: int
    behind_s: float | None
    at_risk_max: int | None
    every_s: float | None
    snapshot_bytes: int


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _overhead(opts: ProtectOptions, scheme: Scheme, base: Path) -> Overhead:
    """One node's cost as a cluster would see it: its trainer (snapshot every step) and four agents at the policy
    under test (`--rate`, `--cpu-share`, `--nice`), all on this machine. Step time with the agents running over the
    same with them stopped (SIGSTOP), interleaved, is what four agents cost one trainer here; the per-node overhead
    is that times node 0's share of the agents' CPU over the timed steps (the peers' work belongs to other nodes;
    on a saturated machine a trainer loses what the others take). Then, agents running freely for `--window`
    seconds of training: node 0's agent CPU per protected GB, its share of the machine's cores (a trainer that
    owns every core slows by share / (1 - share), whatever else loads the machine), protected snapshots per
    snapshot, a snapshot's age when its protection completes, and the time between passes."""
    from hpcft.bench.model import Trainer, config_for_params
    from hpcft.checkpointer import Checkpointer

    roots = [base / f"train{i}" for i in range(NODES)]
    shared = base / "train-shared"
    for r in roots:
        r.mkdir()
    shared.mkdir(mode=0o700)
    job_secret.create(shared)
    trainer = Trainer(config_for_params(opts.params))
    store_pin.announce(secure_dir(job_dir(roots[0], JOB)))  # as this node's agent would before the trainers start
    ckpt = Checkpointer(trainer.model, trainer.optimizer,
                        Options(every=1, keep=2, root=str(roots[0]), job_id=JOB, auto=False))
    agents: list[subprocess.Popen] = []
    committed: dict[int, float] = {}
    plain = Train("plain", trainer, ckpt, [], False, committed)
    try:
        for _ in range(3):  # fill every store slot (keep + 1): their pages are faulted in once, as in a real run
            plain.run_once(0)
            plain.drain()
        t0 = time.perf_counter()
        for _ in range(2):
            plain.run_once(0)
            plain.drain()
        step_s = (time.perf_counter() - t0) / 2
        rank_dir = next(iter(ranks(job_dir(roots[0], JOB)).values()))
        complete = complete_steps(job_dir(roots[0], JOB))
        newest = Bundle(max(complete), complete[max(complete)])
        snapshot_bytes = newest.size
        newest.close()
        for r in roots[1:]:  # the other nodes' agents protect this trainer's snapshots as their own
            j = job_dir(r, JOB)
            j.mkdir(mode=0o700)
            (j / rank_dir.name).symlink_to(rank_dir)
        interval = opts.interval if opts.interval is not None else step_s
        rate = opts.rate or None
        cap = cpu_cores(opts.cpu_share, opts.cpu_cores)
        agents = _agents(roots, shared, scheme, "train", rounds=0, interval=interval, nice=opts.nice,
                         cpu_share=opts.cpu_share, cpu_cores=opts.cpu_cores, rate=rate, lag_bound=opts.lag_bound,
                         lag_cores=budget.ceiling(cap))
        with_p = Train("with_protection", trainer, ckpt, agents, True, committed)
        without = Train("without", trainer, ckpt, agents, False, committed)
        timed0 = [_cpu_s(p.pid) for p in agents]
        timings = run_interleaved([without, with_p], opts.steps, opts.warmup, block=2)
        timed = [_cpu_s(p.pid) - c for p, c in zip(agents, timed0)]  # stopped in the other blocks: all `with`
        share = timed[0] / sum(timed) if sum(timed) > 0 else 0.0  # this node's part of what the agents took
        for p in agents:
            os.kill(p.pid, signal.SIGCONT)
        seen = len(events.read(shared / "events"))
        free = Train("free", trainer, ckpt, agents, True, committed)
        cpu0 = [_cpu_s(p.pid) for p in agents]
        first, trainer_cpu0, wall0 = ckpt.completed, time.process_time(), time.monotonic()
        t_end = time.monotonic() + opts.window
        while time.monotonic() < t_end:
            free.run_once(0)
            free.drain()
        cpu = [_cpu_s(p.pid) - c for p, c in zip(agents, cpu0)]
        trainer_cpu = time.process_time() - trainer_cpu0
        core_share = cpu[0] / ((time.monotonic() - wall0) * len(os.sched_getaffinity(0)))
        snapshots = ckpt.completed - first
        window = events.read(shared / "events")[seen:]
        mine = [e for e in window if e["event"] == "snapshot_protected" and e.get("slot") == 0]
        behind = [e["time"] - committed[e["step"]] for e in mine if e["step"] in committed]
        gb = len(mine) * snapshot_bytes / 1e9
        mean = {v: statistics.mean(timings.samples[v]) for v in ("with_protection", "without")}
        raw = timings.median("with_protection") / timings.median("without") - 1.0
        raw_mean = mean["with_protection"] / mean["without"] - 1.0
        return Overhead(overhead=raw * share, mean_overhead=raw_mean * share, all_agents=raw, all_agents_mean=raw_mean,
                        node_share=share, core_share=core_share,
                        agent_over_trainer=cpu[0] / trainer_cpu if trainer_cpu > 0 else None,
                        cpu_overhead=timings.cpu_median("with_protection") / timings.cpu_median("without") - 1.0,
                        step_s=timings.median("without"), step_cpu_s=timings.cpu_median("without"), rate=rate,
                        cpu_share=opts.cpu_share if opts.cpu_cores is None else None,
                        cpu_cores=cpu_cores(opts.cpu_share, opts.cpu_cores), interval=interval,
                        protect_s=statistics.median(e["seconds"] for e in mine) if mine else None,
                        agent_cpu_s=cpu[0] / gb if gb else None,
                        peer_cpu_s=sum(cpu[1:]) / len(cpu[1:]) / gb if gb else None,
                        protected=len(mine), snapshots=snapshots,
                        stale=sum(1 for e in window if e["event"] == "protect_stale" and e.get("slot") == 0),
                        behind_s=statistics.median(behind) if behind else None,
                        at_risk_max=steps_at_risk_max(committed, [(e["time"], e["step"]) for e in mine]),
                        every_s=statistics.median(b["time"] - a["time"] for a, b in zip(mine, mine[1:]))
                        if len(mine) > 1 else None,
                        snapshot_bytes=snapshot_bytes)
    finally:
        for p in agents:
            p.kill()
            p.wait()
        ckpt.close()


def steps_at_risk_max(committed: dict[int, float], passes: list[tuple[float, int]]) -> int | None:
    """The most snapshots a node lost at any moment of the window would have cost: before each pass completes
    (time, step protected), the newest step committed by then minus the step the previous pass protected."""
    worst = None
    for (_, guarded), (until, _) in zip(passes, passes[1:]):
        newest = max((s for s, t in committed.items() if t <= until), default=guarded)
        worst = max(worst or 0, newest - guarded)
    return worst


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
    idle = [e["seconds"] for e in events.read(shared / "events") if e["event"] == "snapshot_protected"]
    ov = _overhead(opts, scheme, base)
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
        "protect_pass_s_uncapped": max(idle) if idle else None,
        "overhead_with_protection": ov.overhead,
        "mean_overhead_with_protection": ov.mean_overhead,
        "overhead_all_agents_here": ov.all_agents,
        "mean_overhead_all_agents_here": ov.all_agents_mean,
        "node_share_of_agent_cpu": ov.node_share,
        "agent_cpu_over_trainer_cpu_running": ov.agent_over_trainer,
        "agent_share_of_cores": ov.core_share,
        "overhead_from_agent_cpu": ov.core_share / (1 - ov.core_share),
        "cpu_overhead_with_protection": ov.cpu_overhead,
        "step_s": ov.step_s,
        "step_cpu_s": ov.step_cpu_s,
        "snapshot_bytes": ov.snapshot_bytes,
        "rate_bytes_per_s": ov.rate,
        "cpu_share": ov.cpu_share,
        "cpu_cores_cap": ov.cpu_cores,
        "interval_s": ov.interval,
        "protect_s_per_snapshot": ov.protect_s,
        "agent_cpu_s_per_gb": ov.agent_cpu_s,
        "peer_agent_cpu_s_per_gb": ov.peer_cpu_s,
        "agent_cpu_s_per_snapshot": ov.agent_cpu_s * ov.snapshot_bytes / 1e9 if ov.agent_cpu_s else None,
        "agent_cpu_over_trainer_cpu":
            ov.agent_cpu_s * ov.snapshot_bytes / 1e9 / ov.step_cpu_s if ov.agent_cpu_s else None,
        "protected_per_snapshot": ov.protected / ov.snapshots if ov.snapshots else None,
        "protect_every_s": ov.every_s,
        "protected_behind_s": ov.behind_s,
        # a node loss rolls back this many snapshot intervals (measured), and a model of the CPU cap that would
        # bound it to 3: a pass costs agent_cpu_s_per_snapshot core-seconds, lasts that over the cap, and a
        # snapshot waits on average half a pass for the next one to start: lag ≈ 1.5 passes
        "steps_at_risk": ov.behind_s / ov.interval if ov.behind_s is not None and ov.interval else None,
        "steps_at_risk_max": ov.at_risk_max,
        "cores_for_3_steps_at_risk_model": (ov.agent_cpu_s * ov.snapshot_bytes / 1e9) / (3 * ov.interval / 1.5)
        if ov.agent_cpu_s and ov.interval else None,
        "protect_passes_during_training": ov.protected,
        "snapshots_during_training": ov.snapshots,
        "protect_stale_during_training": ov.stale,
    }


def run(opts: ProtectOptions) -> Report:
    """Run the protect bench over every scheme and return its report."""
    set_threads(opts.threads)
    report = Report("protect")
    out = []
    for scheme in [x for x in SCHEMES if not opts.schemes or x.name in opts.schemes]:
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
                   f"{s}: step time (median), this node's protection running vs stopped")
        report.add(f"{s}_mean_overhead_with_protection", rec["mean_overhead_with_protection"], "%",
                   f"{s}: the same, means")
        report.add(f"{s}_overhead_from_agent_cpu", rec["overhead_from_agent_cpu"], "%",
                   f"{s}: this node's agent share of the cores / (1 - share), agents running freely")
        report.add(f"{s}_agent_cpu_s_per_gb", rec["agent_cpu_s_per_gb"], "s",
                   f"{s}: this node's agent, core-seconds per protected GB of snapshot")
        rate = f"{rec['rate_bytes_per_s'] / 1e6:.0f} MB/s" if rec["rate_bytes_per_s"] else "none"
        report.add(f"{s}_protected_per_snapshot", rec["protected_per_snapshot"], "x",
                   f"{s}: snapshots protected per snapshot taken (cap {rec['cpu_cores_cap']:.3f} cores, {rate})")
        report.add(f"{s}_protected_behind_s", rec["protected_behind_s"], "s",
                   f"{s}: a snapshot's age when its protection completes (median)")
        report.add(f"{s}_steps_at_risk", rec["steps_at_risk"], "",
                   f"{s}: that age in snapshot intervals: what a node loss rolls back (measured)")
        report.add(f"{s}_steps_at_risk_max", rec["steps_at_risk_max"], "",
                   f"{s}: the most snapshots a node lost at any moment of the window would have cost (measured)")
        report.add(f"{s}_cores_for_3_steps_at_risk_model", rec["cores_for_3_steps_at_risk_model"], "",
                   f"{s}: agent CPU cap (cores) for at most 3 intervals at risk (model: 1.5 passes of measured CPU)")
    report.note("schemes", out)
    report.note("config", {"nodes": NODES, "state_bytes": opts.state_bytes, "params": opts.params, "steps": opts.steps,
                           "interval_s": opts.interval, "rate": opts.rate,
                           "cpu_share": opts.cpu_share if opts.cpu_cores is None else None, "cpu_cores": opts.cpu_cores,
                           "nice": opts.nice, "lag_bound": opts.lag_bound, "window_s": opts.window,
                           "threads": opts.threads, "agents_on_this_machine": NODES})
    return report
