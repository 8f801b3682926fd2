"""`hpcft chaos`: the bench job (train_job.py) submitted with `hpcft submit` into the sandbox — so that it can be
requeued when the spares run out — while faults of the chosen mix arrive at the given mean interval (schedule.py),
crashed nodes coming back after the repair time; then its goodput, every fault's recovery, the final parameters
against a fault-free run's, and the same arrivals replayed against torch.save every k steps (figures.py)."""
from __future__ import annotations

import math
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hpcft import events
from hpcft.bench import recovery, sandboxed, timeline
from hpcft.chaos import faults as kinds, figures, schedule
from hpcft.errors import ConfigError
from hpcft.report.timeline import try_draw
from hpcft.slurm import state as slurmstate


CALIBRATION_STEPS = 30
BACKEND = "cuda:gloo"  # the job's process groups refuse CPU tensors, as NCCL/RCCL ones do (train_job.py)


@dataclass(frozen=True)
class ChaosOptions:
    mtbf: float = 60.0              # mean seconds between faults (a Poisson process)
    faults: int = 10                # faults to inject
    mix: str = "all"                # kind=weight,… (schedule.parse_mix)
    seed: int = 1
    repair_s: float = 30.0          # a crashed node is powered on again this long after it went down
    steps: int = 0                  # training steps (0: --faults × --mtbf of training at the calibrated step time)
    step_delay: float = 0.5         # seconds of sleep after each step: the step's compute on a real machine
    width: int = 512                # model: `layers` square Linear layers (+ AdamW): 4 × 512² ≈ 1 M parameters
    layers: int = 4
    spares: int = 2                 # beside the job's 4 active nodes (one rank each)
    persist_every: int = 20         # durable flush period (steps), so that losing two nodes of a set costs little
    hang_timeout: float = 5.0       # a hang costs this much; the job's longest gap between steps was 2.15 s (seed 3)
    dir: str | None = None          # a running sandbox with >= nodes + spares nodes (None: start one)
    keep: str | None = None         # keep the runs here (default: a temp dir, removed unless the run failed)
    reference: str | None = None    # a fault-free run of the same steps, width and layers (its final.pt)

    def __post_init__(self) -> None:
        schedule.parse_mix(self.mix)
        if self.keep and Path(self.keep).exists() and any(Path(self.keep).iterdir()):
            raise ConfigError(f"--keep {self.keep} is not empty: name a new or empty directory (nothing is "
                              "overwritten)")

    def training_steps(self, step_s: float) -> int:
        """--steps, or training for --faults mean intervals (and a tenth more) at `step_s` a step: faults keep coming
        until the job ends, so about --faults of them land, at the rate asked for, over the whole run."""
        return self.steps or math.ceil(1.1 * self.faults * self.mtbf / step_s)


def _submit(sb: Any, opts: ChaosOptions, out: Path, steps: int) -> str:
    """`hpcft submit` of the job with spares, XOR protection over all active nodes and a durable flush; its id."""
    bench = recovery.RecoveryOptions(steps=steps, fault_at=1, step_delay=opts.step_delay, width=opts.width,
                                     layers=opts.layers, timeout=0)
    return sandboxed.submit(sb, bench, out, "--nodes", str(timeline.ACTIVE), "--spares", str(opts.spares), "-t", "600",
                           "--protect", "xor", "--group", str(timeline.ACTIVE), "--persist-every",
                           str(opts.persist_every), "--hang-timeout", str(opts.hang_timeout), "--max-restarts",
                           "100000", "--lost-progress-exit", "0", CHAOS="1", BACKEND=BACKEND)


def _fault_free(sb: Any, opts: ChaosOptions, out: Path, steps: int, delay: float) -> Path:
    """The same job under `hpcft run` without faults: the reference (no sleep: the result does not depend on it), or
    the calibration of the step time (with it). Its allocation's time limit and the wait: 10 minutes, and a second
    for each step beyond the sleep (a step takes 0.1 s on the sandbox's 2 cores at the default model)."""
    bench = recovery.RecoveryOptions(steps=steps, fault_at=1, step_delay=delay, width=opts.width, layers=opts.layers,
                                     timeout=600 + steps * (delay + 1.0))
    sandboxed.finish(sandboxed.supervised(sb, bench, out, BACKEND=BACKEND), out, timeout=bench.timeout)
    return out


class Repairs(threading.Thread):
    """Powers crashed nodes on again `repair_s` after they went down, and resumes them in Slurm."""

    def __init__(self, scene: kinds.Scene, repair_s: float):
        super().__init__(name="hpcft-chaos-repairs", daemon=True)
        self.scene, self.repair_s, self.stop = scene, repair_s, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.5):
            with self.scene.lock:
                due = [n for n, t in self.scene.crashed.items() if time.monotonic() - t >= self.repair_s]
                for n in due:
                    del self.scene.crashed[n]
            for node in due:
                self.scene.sb.restart_node(node, wait=False)
                self.scene.sb.runner().run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], check=False)
                events.emit("chaos_repaired", node=node)


def _frontier(scene: kinds.Scene) -> int:
    """The newest step every rank of a launch has completed (-1: none yet)."""
    return max((s for _, s, _ in figures.progress(scene.tail.records())), default=-1)


def _at_most_every(seconds: float, check: Callable[[], bool]) -> Callable[[], bool]:
    """`check`, asked again only once `seconds` have passed (a Slurm query: the waits poll every 0.1 s)."""
    last: list = [-math.inf, False]

    def cached() -> bool:
        if time.monotonic() - last[0] >= seconds:
            last[:] = [time.monotonic(), check()]
        return last[1]

    return cached


def inject(scene: kinds.Scene, plan: list[schedule.Fault], ended: Callable[[], bool],
           say: Callable[[str], None], timeout: float = 600.0) -> list[dict]:
    """Each planned fault at its time from the first step; one due while the run recovers (no step since the last
    fault) waits for the next step, and one with no target present is tried again for 30 s, then skipped."""
    timeline.wait(lambda: _frontier(scene) >= 0 or ended(), "the first step", timeout)
    t0, frontier, done = time.time(), -1, []
    for f in plan:
        while time.time() < t0 + f.at and not ended():
            time.sleep(0.05)
        while _frontier(scene) < frontier + 2 and not ended():  # the last fault's step and one more trained
            time.sleep(0.1)
        if ended():
            break
        deadline, target, at, why = time.monotonic() + 30, None, time.time(), "the job ended"
        while target is None and time.monotonic() < deadline and not ended():
            at = time.time()
            try:
                target = kinds.INJECT[f.kind](scene, f.pick)
            except kinds.NoTarget as exc:
                why = str(exc)
                time.sleep(0.5)
        record = {"planned_s": f.at, "t": round(at - t0, 3), "at": at, "kind": f.kind, "target": target}
        if target is None:
            record["skipped"] = why if not ended() else "the job ended"
        else:
            frontier = _frontier(scene)
        done.append(record)
        say(f"  fault {len(done)} at +{at - t0:.1f} s: {f.kind} → {target or record['skipped']}")
    return done


def _save_seconds(opts: ChaosOptions, into: Path) -> float:
    """What the baseline's torch.save of this job's state costs here (median of 5, written then renamed)."""
    import torch

    body = [m for _ in range(opts.layers) for m in (torch.nn.Linear(opts.width, opts.width), torch.nn.Tanh())]
    model = torch.nn.Sequential(*body, torch.nn.Linear(opts.width, 1))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, opts.width)).sum().backward()
    opt.step()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, into / "save.tmp")
        os.replace(into / "save.tmp", into / "save.pt")
        times.append(time.perf_counter() - t)
    (into / "save.pt").unlink()
    return statistics.median(times)


def figures_of(opts: ChaosOptions, out: Path, ref: Path, injected: list[dict], steps: int, save_s: float) -> dict:
    """The run's JSON object (docs/results.md's chaos section reads it)."""
    records = timeline.read(out)
    curve = figures.progress(records)
    step_s = figures.step_seconds(curve)
    log = events.read(out / "job")
    start = min(e["time"] for e in log if e["event"] == "start")
    end = max(t for t, _, _ in curve)
    restored = [(r["t"], r["step"]) for r in records if r["what"] == "restored"]
    complete = max((s for _, s, _ in curve), default=-1) >= steps - 1  # step indices 0 … steps - 1
    for f in injected:  # a fault is survived when the job trained every step after it (recovery None: none was left)
        if "skipped" not in f:
            o = figures.outcome(curve, restored, f["at"], figures.in_flight(records, f["at"]))
            f.update(recovery_s=None if o.recovery_s is None else round(o.recovery_s, 3), steps_lost=o.steps_lost,
                     survived=complete)
    hit = [f for f in injected if "skipped" not in f]
    zero = hit[0]["at"] - hit[0]["t"] if hit else start  # the faults' times count from the first step inject saw
    first_steps = [r["t"] for r in records if r["what"] == "step" and r["run"] == "0.0"]
    restart_s = (min(first_steps) - start if first_steps else 0.0) + save_s  # a cold launch, then torch.load
    arrivals = schedule.arrivals(opts.seed, opts.mtbf, until=1000 * steps * step_s)
    base, k = figures.baseline(steps, step_s, save_s, restart_s, opts.mtbf, arrivals)
    return {
        "seed": opts.seed, "mtbf_s": opts.mtbf, "mix": schedule.parse_mix(opts.mix), "faults_asked": opts.faults,
        "faults_injected": len(hit), "faults_survived": len(hit) if complete else 0,
        "goodput": round(figures.goodput(steps, step_s, end - start), 4) if complete else 0.0,
        "goodput_baseline": round(base, 4), "step_s": round(step_s, 4), "wall_s": round(end - start, 3),
        "steps": steps, "completed": complete, "final_equal": complete and recovery.identical(out, ref),
        "kinds": figures.by_kind(hit), "curve": figures.thin(curve, zero),
        "faults": [{k: v for k, v in f.items() if k != "at"} for f in injected],
        "baseline": {"save_s": round(save_s, 4), "interval_steps": k, "restart_s": round(restart_s, 3)},
        "requeues": max((e.get("requeues", 0) for e in log if e["event"] == "start"), default=0),
        "requeue_wait_s": round(sum(figures.requeue_waits(log)), 1),
        "job_dir": str(out / "job"), "options": asdict(opts),
    }


def run(opts: ChaosOptions, say: Callable[[str], None]) -> dict:
    """The chaos run end to end (sandbox, reference, faulted run, figures); its JSON object."""
    plan = schedule.draw(opts.seed, opts.mtbf, 3 * opts.faults + 10, schedule.parse_mix(opts.mix))
    say(f"chaos: seed {opts.seed}, about {opts.faults} faults at mean interval {opts.mtbf:g} s; the schedule, followed "
        "until the job ends:")
    for i, f in enumerate(plan, 1):
        say(f"  {i:3d}. +{f.at:8.1f} s  {f.kind}")
    keep = Path(opts.keep) if opts.keep else Path(tempfile.mkdtemp(prefix="hpcft-chaos-"))
    # one node beyond the job's own when starting a sandbox: a requeued job need not wait for a repair to start
    with sandboxed.sandbox(opts.dir, timeline.ACTIVE + opts.spares, idle=1) as sb:
        sb.heal()
        steps = opts.steps
        if not steps:
            calibration = _fault_free(sb, opts, keep / "calibration", CALIBRATION_STEPS, opts.step_delay)
            steps = opts.training_steps(figures.step_seconds(figures.progress(timeline.read(calibration))))
        say(f"chaos: {steps} training steps")
        ref = Path(opts.reference) if opts.reference else _fault_free(sb, opts, keep / "reference", steps, 0.0)
        out = keep / "chaos"
        out.mkdir(parents=True)
        job = _submit(sb, opts, out, steps)
        scene = kinds.Scene(sb, out, job)
        repairs = Repairs(scene, opts.repair_s)
        repairs.start()
        runner = sb.runner()
        try:
            injected = inject(scene, plan, _at_most_every(1.0, lambda: slurmstate.job_ended(runner, job)), say)
            timeline.wait(lambda: slurmstate.job_ended(runner, job), "the job to end",
                          timeout=600 + 4 * steps * (opts.step_delay + 0.1))
        finally:
            repairs.stop.set()
            runner.run(["scancel", job], check=False)
            sb.heal()
        png, drawn = try_draw(out / "job", keep / "timeline.png",
                              marks=[(f["at"], f["kind"], "injected") for f in injected if "skipped" not in f])
        result = figures_of(opts, out, ref, injected, steps, _save_seconds(opts, keep))
        result["timeline"] = str(png) if png else None
        say(drawn)
    say(f"chaos: {result['faults_survived']}/{result['faults_injected']} faults survived, goodput "
        f"{result['goodput']:.3f} (torch.save every {result['baseline']['interval_steps']} steps: "
        f"{result['goodput_baseline']:.3f}), final {'equal' if result['final_equal'] else 'DIFFERENT'}; in {keep}")
    return result
