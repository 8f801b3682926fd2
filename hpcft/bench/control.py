"""`hpcft bench control`: what a protected job at steady state asks of the machine's shared services, from a real
sandbox run (the recovery bench's job, `hpcft run --protect xor` on 4 nodes, one rank each): the RPCs slurmctld
counts (`sdiag`'s per-type counters before and after the window, its own REQUEST_STATS_INFO left out; the sandbox's
slurmctld serves this job alone) and the file-system operations on the job directory (the shared file system's stand-in)
of hpcft's per-node processes (janitors, agents, standbys, the trainers' task wrappers and reporters), counted with
`strace -f -e trace=%file` attached to them for the window: the calls that name a path (open, stat, rename, unlink,
mkdir, utime…), what loads a parallel file system's metadata servers; reads and writes on an open file follow an open,
which is counted. The supervisor's apart; the trainers are not traced (ptrace stops a process at every system call).
strace slows what it traces: the job runs with `--loss-timeout` LOSS_TIMEOUT_S so that a traced agent is not taken
for a silent one. Each figure is modelled at `--scale` nodes (Frontier: 9,408) beside the measurement, its formula in
the report."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcft.bench import timeline
from hpcft.bench.harness import Report
from hpcft.bench.sandboxed import allocation, end_allocation, measured
from hpcft.bench.timeline import ACTIVE
from hpcft.errors import ConfigError, HpcftError

FRONTIER_NODES = 9408
OWN_RPCS = ("REQUEST_STATS_INFO",)  # sdiag's own: the bench's, not the job's
DAEMON_RPCS = ("MESSAGE_NODE_REGISTRATION_STATUS",)  # slurmd answering slurmctld's own checks: every node has them
LOSS_TIMEOUT_S = 15.0  # the job's --loss-timeout: an agent slowed by strace is not named silent
TARGETS = {"slurm_rpcs_per_min": 2.0, "shared_fs_ops_per_node_per_min": 0.0}  # issue #32's
# hpcft's processes on the nodes, by what their command line runs (the rest there are the trainers)
KINDS = (("janitor", "hpcft.launch.node.janitor"), ("agent", "hpcft.agent"), ("agent", "hpcft.launch.node.handoff"),
         ("standby", "hpcft.launch.node.standby"), ("reporter", "hpcft.launch.node.task"))
HELPERS = ("janitor", "agent", "standby", "reporter")
_RPC = re.compile(r"^\s+(\w+)\s+\(\s*\d+\)\s+count:(\d+)", re.MULTILINE)


@dataclass(frozen=True)
class ControlOptions:
    dir: str | None = None          # a running sandbox with >= 4 nodes; None: start one, stop it afterwards
    window: float = 60.0            # seconds measured at steady state
    warmup: float = 20.0            # seconds of training after every agent protected a step, before the window
    slurm_check_every: float | None = None  # hpcft run's --slurm-check-every (None: its default)
    step_delay: float = 0.2         # seconds of sleep after each training step
    width: int = 256                # the job's model (train_job.py)
    layers: int = 2
    poll_interval: float = 1.0      # hpcft run's options (its defaults)
    probe_timeout: float = 15.0
    kill_grace: float = 10.0
    timeout: float = 300.0          # for the job to get to steady state
    scale: int = FRONTIER_NODES     # the machine the figures are modelled at
    keep: str | None = None         # keep the run's output here (else a temp dir, removed unless the bench fails)

    @property
    def steps(self) -> int:
        """Enough steps that the job outlives the bench (it is stopped after the window)."""
        return int((self.timeout + self.warmup + self.window) / max(self.step_delay, 0.01)) + 1000

    def __post_init__(self) -> None:
        if self.window < 10 or self.warmup < 0:
            raise ConfigError(f"--window must be at least 10 s and --warmup at least 0 (got {self.window:g}, "
                              f"{self.warmup:g})")
        if not _which("strace"):
            raise ConfigError("hpcft bench control counts file-system operations with strace: install it "
                              "(Debian: apt-get install strace)")


def _which(name: str) -> bool:
    return any(os.access(Path(d) / name, os.X_OK) for d in os.environ.get("PATH", "").split(os.pathsep) if d)


def rpc_counts(sdiag: str) -> dict[str, int]:
    """{message type: count} from `sdiag`'s "Remote Procedure Call statistics by message type"."""
    part = sdiag.split("by message type", 1)[-1].split("by user", 1)[0]
    return {name: int(count) for name, count in _RPC.findall(part)}


def rpcs_between(before: dict[str, int], after: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """(the job's RPCs by type, those left out: sdiag's own and the node daemons') between two `rpc_counts`."""
    moved = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
    left = {k: v for k, v in moved.items() if k in OWN_RPCS + DAEMON_RPCS}
    return {k: v for k, v in moved.items() if k not in left}, left


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def processes(job_id: str, job_dir: str) -> dict[str, list[int]]:
    """The job's processes on this machine by kind: KINDS on the nodes, `trainer` for the rest there, `supervisor`
    (`hpcft run`, off the nodes); srun and salloc left out. Each names `job_dir` in its command line or environment
    (other sandboxes here number their jobs from 1 too). A standby's forked child (a warm start) is of its wrapper's
    kind, the task whose stdout it took over: an agent for the agents' handoff, a trainer for the task wrapper."""
    found: dict[str, list[int]] = {}
    parent: dict[int, int] = {}
    stdout: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            env = _environ(pid)
            parent[pid] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            stdout[pid] = os.readlink(entry / "fd" / "1")
        except (OSError, ValueError, IndexError):
            continue
        line = " ".join(argv)
        if env.get("SLURM_JOB_ID") != job_id or Path(argv[0]).name in ("srun", "salloc", "nsenter") or \
                not (job_dir in line or any(job_dir in v for v in env.values())):
            continue
        if not env.get("SLURMD_NODENAME"):
            kind = "supervisor" if " run " in line and "hpcft" in line else ""
        else:
            kind = next((k for k, marker in KINDS if marker in line), "trainer")
        if kind:
            found.setdefault(kind, []).append(pid)
    standbys = set(found.get("standby", ()))
    wrappers = {stdout[p]: ("agent" if k == "agent" else "trainer") for k in ("agent", "reporter")
                for p in found.get(k, ())}
    for child in [p for p in standbys if parent.get(p) in standbys]:
        found["standby"].remove(child)
        found.setdefault(wrappers.get(stdout[child], "trainer"), []).append(child)
    return found


def trace(pids: list[int], log: Path) -> subprocess.Popen:
    """strace attached to `pids` and their threads and children, their calls that name a path, into `log`."""
    argv = ["strace", "-f", "-qq", "-y", "-e", "trace=%file", "-o", str(log)]
    for pid in pids:
        argv += ["-p", str(pid)]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def fs_ops(log: Path, under: str, durable: str) -> tuple[Counter, Counter]:
    """{(syscall, file name with digits as N): count} of the traced calls on paths under `under`: (the durable tier's,
    under `durable`: the flush's data; the rest: the control plane's)."""
    ops: Counter = Counter()
    data: Counter = Counter()
    if not log.exists():
        return data, ops
    for line in log.read_text(errors="replace").splitlines():
        if under not in line or "resumed>" in line:
            continue
        call = re.match(r"^\d+\s+(\w+)\(", line)
        path = re.search(re.escape(under) + r"([^\"<>]*)", line)
        name = re.sub(r"\d+", "N", Path(path.group(1)).name if path else "?") or "."
        (data if durable in line else ops)[(call.group(1) if call else "?", name)] += 1
    return data, ops


def _start(sb: Any, opts: ControlOptions, out: Path) -> subprocess.Popen:
    """`salloc -N4 --no-kill hpcft run --protect xor … -- python train_job.py` in the sandbox."""
    extra = ["--slurm-check-every", f"{opts.slurm_check_every:g}"] if opts.slurm_check_every else []
    return allocation(sb, opts, out, (), "--protect", "xor", "--loss-timeout", f"{LOSS_TIMEOUT_S:g}", *extra)


def _steady(out: Path, opts: ControlOptions, proc: subprocess.Popen) -> str:
    """Wait until every agent protected a step; the job's id (from the supervisor's events)."""
    from hpcft import events
    from hpcft.agent import status

    def protected() -> bool:
        st = list(status.read(out / "job" / "agents", "0").values())
        return len(st) == ACTIVE and all((s.get("protected") or -1) >= 1 for s in st)

    timeline.wait(lambda: time.sleep(0.5) or protected(), "every agent to protect a step", opts.timeout, proc)
    return str(next(e["job"] for e in events.read(out / "job") if e["event"] == "start"))


def measure(sb: Any, opts: ControlOptions, out: Path) -> dict[str, Any]:
    """One steady-state window of the job: RPCs by type, FS ops by kind of process."""
    proc = _start(sb, opts, out)
    try:
        job = _steady(out, opts, proc)
        time.sleep(opts.warmup)
        kinds = processes(job, str((out / "job").resolve()))
        if not all(kinds.get(k) for k in ("supervisor", "agent")) or len(kinds.get("janitor", ())) != ACTIVE:
            raise HpcftError(f"the job's processes were not found on this machine as expected (a supervisor, agents, "
                             f"one janitor per node): {kinds}")
        traces = {k: trace(pids, out / f"strace-{k}.log") for k, pids in kinds.items() if k != "trainer"}
        time.sleep(2.0)  # attached
        runner = sb.runner()
        before, began = rpc_counts(runner.run(["sdiag"]).stdout), time.monotonic()
        time.sleep(opts.window)
        after, seconds = rpc_counts(runner.run(["sdiag"]).stdout), time.monotonic() - began
        for t in traces.values():
            t.send_signal(signal.SIGINT)
        for t in traces.values():
            t.wait(timeout=30)
    finally:
        end_allocation(proc)
    job_rpcs, left_out = rpcs_between(before, after)
    under = str((out / "job").resolve())
    traced = {k: fs_ops(out / f"strace-{k}.log", under, f"{under}/checkpoints") for k in kinds if k != "trainer"}
    return {"seconds": seconds, "rpcs": job_rpcs, "left_out": left_out, "ops": {k: t[1] for k, t in traced.items()},
            "durable": {k: t[0] for k, t in traced.items()}, "pids": {k: len(v) for k, v in kinds.items()}}


def report(m: dict[str, Any], opts: ControlOptions) -> Report:
    """The figures per minute, and each modelled at `opts.scale` nodes with its formula."""
    minutes, n, scale = m["seconds"] / 60.0, ACTIVE, opts.scale
    rpm = sum(m["rpcs"].values()) / minutes
    def per_min(what: str, kinds: tuple[str, ...], nodes: int = n) -> float:
        return sum(sum(m[what].get(k, Counter()).values()) for k in kinds) / nodes / minutes

    helper, sup = per_min("ops", HELPERS), per_min("ops", ("supervisor",), 1)
    r = Report("control", judge=lambda f: {k: f[k] <= limit for k, limit in TARGETS.items()})
    r.add("slurm_rpcs_per_min", round(rpm, 2), "/min", f"RPCs at slurmctld, the job at steady state ({n} nodes)")
    r.add("slurm_rpcs_per_min_at_scale", round(rpm, 2), "/min", f"  modelled per job at {scale} nodes")
    r.add("slurm_rpcs_per_node_per_min_at_scale", rpm / scale, "/min", f"  modelled per node at {scale} nodes")
    r.add("shared_fs_ops_per_node_per_min", round(helper, 2), "/min",
          "shared-FS ops per node: janitors, agents, standbys, reporters")
    r.add("shared_fs_ops_per_min_at_scale", round(helper * scale, 1), "/min", f"  modelled per job at {scale} nodes")
    for kind in HELPERS:
        r.add(f"shared_fs_ops_per_node_per_min_{kind}", round(per_min("ops", (kind,)), 2), "/min", f"  {kind}s")
    r.add("durable_fs_ops_per_node_per_min", round(per_min("durable", HELPERS), 2), "/min",
          "the flush's writes to the durable tier per node (data, every --persist-every steps; not counted above)")
    r.add("supervisor_fs_ops_per_min", round(sup, 2), "/min", "shared-FS ops of the supervisor (one per job)")
    r.note("model", {
        "slurm_rpcs_per_min_at_scale": "measured per job: the supervisor's steady looks are one `scontrol show node` "
                                       "of all slots whatever N (2 RPCs: node and partition info), 60 / "
                                       "--slurm-check-every a minute; per node: that / N",
        "shared_fs_ops_per_min_at_scale": "shared_fs_ops_per_node_per_min x N (each node's helpers alike)",
        "supervisor_fs_ops_per_min": "one writer per job: events.jsonl and status.json (at most once a second, less "
                                     "for a large job's log), not multiplied by N"})
    r.note("window_s", round(m["seconds"], 2))
    r.note("nodes", n)
    r.note("scale", scale)
    r.note("slurm_rpcs_by_type", m["rpcs"])
    r.note("slurm_rpcs_left_out", m["left_out"])
    r.note("processes", m["pids"])
    r.note("fs_ops_by_kind", {k: {f"{call} {name}": c for (call, name), c in ops.most_common(12)}
                              for k, ops in m["ops"].items() if ops})
    r.note("slurm_check_every", opts.slurm_check_every)
    return r


def run(opts: ControlOptions) -> Report:
    """One sandbox, one job, one window (see module doc)."""
    with measured(opts.dir, ACTIVE, opts.keep, "hpcft-bench-control-") as (sb, work):
        m = measure(sb, opts, work / "steady")
    print(f"hpcft bench control: {m['pids']} processes traced for {m['seconds']:.1f} s", file=sys.stderr)
    return report(m, opts)
