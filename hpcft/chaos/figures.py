"""The chaos run's figures from what the job recorded (pure): the training's progress over wall time, goodput, each
fault's recovery time and steps lost, and the same fault arrivals replayed against torch.save every k steps with k
from Young's formula (the baseline)."""
from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass


def progress(records: Iterable[dict]) -> list[tuple[float, int, str]]:
    """(when, step, launch) of each step every rank of a launch completed, in time order: a step is complete when
    the last of that launch's ranks recorded it (train_job.py's `step` records; `run`: the launch)."""
    ranks: dict[str, set[int]] = {}
    steps: dict[tuple[str, int], list[float]] = {}
    for r in records:
        if r["what"] == "init":
            ranks.setdefault(r["run"], set()).add(r["rank"])
        elif r["what"] == "step":
            steps.setdefault((r["run"], r["step"]), []).append(r["t"])
    done = [(max(ts), step, run) for (run, step), ts in steps.items() if len(ts) >= len(ranks.get(run, ()))]
    return sorted(done)


def thin(curve: list[tuple[float, int, str]], start: float, points: int = 800) -> list[list[float]]:
    """The progress `curve` as [[seconds since `start`, step], …] for the results page's timeline: about `points`
    evenly spaced points plus both ends of every launch, so that each fall back to a snapshot stays drawn."""
    stride = max(1, math.ceil(len(curve) / points))
    keep = [i for i, (_, _, run) in enumerate(curve) if i % stride == 0 or i == len(curve) - 1
            or curve[i - 1][2] != run or curve[i + 1][2] != run]
    return [[round(curve[i][0] - start, 2), curve[i][1]] for i in keep]


def step_seconds(curve: list[tuple[float, int, str]]) -> float:
    """The fault-free step time: the median gap between consecutive steps of one launch."""
    gaps = [b[0] - a[0] for a, b in zip(curve, curve[1:]) if a[2] == b[2] and b[1] == a[1] + 1]
    if not gaps:
        raise ValueError("no two consecutive steps in one launch: the run is too short to time a step")
    return statistics.median(gaps)


@dataclass
class Outcome:
    """What became of one injected fault: seconds to the first step after it, and the steps trained again."""
    recovery_s: float | None
    steps_lost: int


def in_flight(records: Iterable[dict], at: float) -> tuple[str, int] | None:
    """(launch, step) of the newest step any rank had recorded by `at`: its peers may complete it after a fault."""
    done = [(r["t"], r["run"], r["step"]) for r in records if r["what"] == "step" and r["t"] <= at]
    return max(done)[1:] if done else None


def outcome(curve: list[tuple[float, int, str]], restored: list[tuple[float, int]], at: float,
            flight: tuple[str, int] | None = None) -> Outcome:
    """The fault at `at`: the first step completed after it (None: none was), not counting the steps some rank had
    already recorded (`flight`: in_flight), and how far the next launch that resumed after it went back from the
    newest step complete before it (`restored`: (when, step resumed from))."""
    before = max((s for t, s, _ in curve if t <= at), default=-1)  # step indices: resuming at r redoes r..before
    after = next(((t, s) for t, s, run in curve if t > at and (flight is None or run != flight[0] or s > flight[1])),
                 None)
    resumed = [s for t, s in restored if t > at and (after is None or t <= after[0])]
    return Outcome(None if after is None else after[0] - at, max(0, before + 1 - min(resumed)) if resumed else 0)


def goodput(steps: int, step_s: float, wall_s: float) -> float:
    """The share of the wall time that became training in the final model: its steps at the fault-free step time."""
    return steps * step_s / wall_s if wall_s > 0 else 0.0


def young_interval(save_s: float, mtbf: float, step_s: float) -> int:
    """Steps between saves by Young's formula, sqrt(2 × save time × MTBF), at least one."""
    return max(1, round(math.sqrt(2 * save_s * mtbf) / step_s))


def baseline(steps: int, step_s: float, save_s: float, restart_s: float, mtbf: float,
             arrivals: list[float]) -> tuple[float, int]:
    """(goodput, k) of torch.save every k steps (Young's k) under the faults at `arrivals` (seconds from the start):
    each fault costs the steps since the last save plus `restart_s` (relaunch, imports, process group, torch.load),
    and a fault during a restart starts it again. Generous to the baseline: every fault is found at once."""
    k = young_interval(save_s, mtbf, step_s)
    t, done, saved, i = 0.0, 0, 0, 0
    while done < steps:
        cost = step_s + (save_s if (done + 1) % k == 0 else 0.0)
        nxt = arrivals[i] if i < len(arrivals) else math.inf
        if t + cost <= nxt:
            t, done = t + cost, done + 1
            saved = done if done % k == 0 else saved
            continue
        if nxt == math.inf:
            return 0.0, k  # the replay ran past the arrivals given: none could finish
        t, done = nxt + restart_s, saved
        i += 1
        while i < len(arrivals) and arrivals[i] < t:
            t, i = arrivals[i] + restart_s, i + 1
    return goodput(steps, step_s, t), k


def requeue_waits(log: Iterable[dict]) -> list[float]:
    """Seconds from each requeue (hpcft run's, or a janitor's for a lost batch host) to the start of the run Slurm
    started next, from the job's events: Slurm's hold of a requeued job, its wait for nodes and the requeued run's
    start, while no rank trains (docs/results.md separates it from the recoveries inside the allocation)."""
    waits, since = [], None
    for e in log:
        if e["event"] == "requeue" or (e["event"] == "batch_host_lost" and e.get("action") == "requeue"):
            since = e["time"] if since is None else since
        elif e["event"] == "start" and since is not None:
            waits.append(e["time"] - since)
            since = None
    return waits


def by_kind(faults: list[dict]) -> dict[str, dict]:
    """Per kind: count, recovery time median and max, steps lost median and max (survived faults only timed)."""
    out: dict[str, dict] = {}
    for kind in dict.fromkeys(f["kind"] for f in faults):
        mine = [f for f in faults if f["kind"] == kind]
        rec = [f["recovery_s"] for f in mine if f["recovery_s"] is not None]
        lost = [f["steps_lost"] for f in mine]
        out[kind] = {"count": len(mine),
                     "recovery_s_median": round(statistics.median(rec), 3) if rec else None,
                     "recovery_s_max": round(max(rec), 3) if rec else None,
                     "steps_lost_median": statistics.median(lost) if lost else None,
                     "steps_lost_max": max(lost) if lost else None}
    return out
