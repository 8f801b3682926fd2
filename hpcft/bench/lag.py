"""`hpcft bench protect --dir SANDBOX`: protection's lag in a real job laid out as the machine lays it out. `hpcft run
--protect xor` on 4 nodes of the sandbox (a confined one: `hpcft sandbox up --confine`), `--tasks-per-node` ranks a
node holding every core Slurm gives the job (the agents' step overlaps them with the CPU budget and priority `hpcft
run` sets), a snapshot every step of a model of `--params`; at steady state, `hpcft status`'s view of the job is
sampled twice a second over the window: steps at risk (the newest staged step − the newest protected or durable one,
what a node lost then would cost), the agents' CPU cap in force. The in-process bench (without --dir) measures the
schemes' costs; this one whether protection keeps up where the trainers own the cores."""
from __future__ import annotations

import math
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcft.bench import timeline
from hpcft.bench.harness import Report
from hpcft.bench.sandboxed import allocation, end_allocation, measured
from hpcft.bench.timeline import ACTIVE
from hpcft.errors import ConfigError, HpcftError

TARGET = 3  # issue #32: steps_at_risk at most 3
WIDTH = 1024  # the job's square layers; --params sets their number
LAYER_PARAMS = WIDTH * WIDTH + WIDTH  # one Linear(WIDTH, WIDTH)


@dataclass(frozen=True)
class LagOptions:
    dir: str                        # a running sandbox with >= 4 nodes
    params: int = 20_000_000        # the model's parameters (+ AdamW's two states: 12 bytes a parameter snapshotted)
    tasks_per_node: int = 2         # ranks a node, each with its share of the node's cores
    window: float = 60.0            # seconds sampled at steady state
    warmup: float = 10.0            # seconds of training after every agent protected a step, before the window
    lag_bound: int | None = None    # hpcft run --protect-lag (None: its default)
    agent_cores: float | None = None  # hpcft run --agent-cores (None: the profile's)
    step_delay: float = 0.0         # seconds of sleep after each step, beside its compute
    poll_interval: float = 1.0      # hpcft run's options (its defaults)
    probe_timeout: float = 15.0
    kill_grace: float = 10.0
    timeout: float = 600.0          # for the job to get to steady state
    keep: str | None = None         # keep the run's output here (else a temp dir, removed unless the bench fails)

    def __post_init__(self) -> None:
        if self.window < 10 or self.warmup < 0 or self.tasks_per_node < 1:
            raise ConfigError(f"--window must be at least 10 s, --warmup at least 0 and --tasks-per-node at least 1 "
                              f"(got {self.window:g}, {self.warmup:g}, {self.tasks_per_node})")
        if self.keep and Path(self.keep).exists() and any(Path(self.keep).iterdir()):
            raise ConfigError(f"--keep {self.keep} is not empty: name a new or empty directory (nothing is "
                              "overwritten)")

    @property
    def width(self) -> int:
        return WIDTH

    @property
    def layers(self) -> int:
        return max(1, round(self.params / LAYER_PARAMS))

    @property
    def steps(self) -> int:
        """More steps than the bench can see: the job is stopped after the window."""
        return 1_000_000


def _start(sb: Any, opts: LagOptions, out: Path, protect: str = "xor") -> subprocess.Popen:
    """`salloc -N4 --ntasks-per-node T --no-kill hpcft run --protect PROTECT --tasks-per-node T … -- train_job.py`."""
    extra = [*(["--protect-lag", str(opts.lag_bound)] if opts.lag_bound is not None else []),
             *(["--agent-cores", f"{opts.agent_cores:g}"] if opts.agent_cores is not None else [])]
    return allocation(sb, opts, out, (f"--ntasks-per-node={opts.tasks_per_node}",), "--protect", protect, "--group",
                      str(ACTIVE), "--tasks-per-node", str(opts.tasks_per_node), *extra, OMP_NUM_THREADS="1")


def _view(job_dir: Path) -> Any:
    from hpcft import status

    try:
        return status.collect(job_dir)
    except ConfigError:
        return None  # no agent reports yet


def sample(job_dir: Path, opts: LagOptions, proc: subprocess.Popen) -> list[dict[str, Any]]:
    """Wait for steady state (every agent protected a step, then the warm-up), then `hpcft status`'s view of the job
    twice a second for the window: one record per look."""
    def steady() -> bool:
        view = _view(job_dir)
        return view is not None and len(view.nodes) == ACTIVE and \
            all((n.protected or -1) >= 1 for n in view.nodes) and not time.sleep(0.5)

    timeline.wait(steady, "every agent to protect a step", opts.timeout, proc)
    time.sleep(opts.warmup)
    looks, end = [], time.monotonic() + opts.window
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise HpcftError(f"the job ended (exit {proc.returncode}) during the window; see {job_dir.parent}/run.log")
        view = _view(job_dir)
        if view is not None and view.steps_at_risk is not None:
            looks.append({"t": time.time(), "training": view.training, "at_risk": view.steps_at_risk,
                          "warned": bool(view.warnings),
                          "caps": [n.cpu_cores for n in view.nodes if n.cpu_cores is not None],
                          "budget": next((n.cpu_budget for n in view.nodes if n.cpu_budget is not None), None),
                          "ceiling": next((n.cpu_ceiling for n in view.nodes if n.cpu_ceiling is not None), None)})
        time.sleep(0.5)
    return looks


def step_seconds(out: Path, since: float) -> float | None:
    """Rank 0's mean step time in the job's timeline (train_job.py's records) after `since`."""
    times = [r["t"] for r in timeline.read(out) if r["what"] == "step" and r.get("rank") == 0 and r["t"] >= since]
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None


def unprotected(sb: Any, opts: LagOptions, out: Path) -> float | None:
    """The same job's step time with `--protect none`, over the same warm-up and window: the yardstick of the
    protected job's step time."""
    proc = _start(sb, opts, out, protect="none")
    try:
        timeline.wait(lambda: time.sleep(0.5) or step_seconds(out, 0.0), "the unprotected job's first steps",
                      opts.timeout, proc)
        time.sleep(opts.warmup)
        began = time.time()
        time.sleep(opts.window)
        return step_seconds(out, began)
    finally:
        end_allocation(proc)


def report(looks: list[dict[str, Any]], opts: LagOptions, cpus: dict[str, str], step_s: float | None,
           base_s: float | None) -> Report:
    """The window's figures; met when the median look has at most TARGET steps at risk."""
    if len(looks) < 2:
        raise HpcftError("fewer than 2 looks at the job during the window: nothing to report")
    risk = sorted(x["at_risk"] for x in looks)
    seconds = looks[-1]["t"] - looks[0]["t"]
    raised = [x for x in looks if x["caps"] and x["budget"] is not None and max(x["caps"]) > x["budget"]]
    r = Report("lag", judge=lambda f: {"steps_at_risk": f["steps_at_risk"] <= TARGET})
    r.add("steps_at_risk", statistics.median(risk), "steps", "steps a node lost now would cost (median of the window)")
    r.add("steps_at_risk_p95", risk[min(len(risk) - 1, math.ceil(0.95 * len(risk)) - 1)], "steps", "  95th percentile")
    r.add("steps_at_risk_max", risk[-1], "steps", "  the most")
    r.add("step_s", step_s, "s", "the trainers' step time, protected")
    r.add("step_s_unprotected", base_s, "s", "  the same job's with --protect none")
    r.add("step_overhead", step_s / base_s - 1 if step_s and base_s else None, "%", "  protection's step overhead")
    r.add("lag_warned_share", sum(x["warned"] for x in looks) / len(looks), "",
          "share of looks where `hpcft status` warned of protection trailing")
    r.add("cap_raised_share", len(raised) / len(looks), "",
          "share of looks with an agent's cap raised by the lag bound")
    r.note("agents_cpu_budget_cores", looks[-1]["budget"])
    r.note("agents_cpu_ceiling_cores", looks[-1]["ceiling"])
    r.note("layout", {"nodes": ACTIVE, "tasks_per_node": opts.tasks_per_node, "node_cpus": cpus,
                      "params": opts.layers * LAYER_PARAMS, "snapshot_bytes_per_rank_approx":
                      12 * opts.layers * LAYER_PARAMS, "protect": f"xor over {ACTIVE}"})
    r.note("window_s", round(seconds, 2))
    r.note("looks", len(looks))
    r.note("lag_bound", opts.lag_bound)
    return r


def run(opts: LagOptions) -> Report:
    """The job unprotected, then protected, in the sandbox at `opts.dir` (see module doc)."""
    with measured(opts.dir, ACTIVE, opts.keep, "hpcft-bench-lag-") as (sb, work):
        base_s = unprotected(sb, opts, work / "unprotected")
        out = work / "protected"
        proc = _start(sb, opts, out)
        try:
            looks = sample(out / "job", opts, proc)
            cpus = sb.runner().run(["sinfo", "--noheader", "--Node", "--format=%N %c"]).stdout
        finally:
            end_allocation(proc)
        step_s = step_seconds(out, looks[0]["t"]) if looks else None
    return report(looks, opts, dict(line.split(None, 1) for line in cpus.splitlines() if line.strip()), step_s,
                  base_s)
