"""A run's account from its job directory alone: the events log (`events.jsonl`: decisions, faults, restores, lost
progress, summaries) read against the progress history of the bounded log (`launch.node.progress.history`). Each
decision and in-process restart is an incident with what it cost: the steps lost and the recovery time."""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcft import events
from hpcft.launch.node import progress

# A decision's cause, or a fault event, to the kind of mark it is on the timeline (its colour)
KINDS = {"node_failed": "node", "allocation_lost": "node", "task_failed": "task", "hang": "hang",
         "walltime": "walltime", "agent_failed": "agents", "straggler": "straggler", "nodes_returned": "reshape",
         "step_refused": "stop", "error": "stop", "inprocess_restart": "inprocess"}
FAULTS = {"node_bad": "node", "node_closed": "node", "previous_run": "node", "agents_failed": "agents",
          "agents_restart": "agents", "progress_blind": "agents", "straggler": "straggler", "signal": "walltime"}
_META = ("event", "time", "level", "job")  # an event's fields that are not its content


@dataclass(frozen=True)
class Mark:
    """A moment of the run worth a line on its timeline: `kind` picks the colour (KINDS' values, or the caller's)."""
    time: float
    label: str
    kind: str


@dataclass(frozen=True)
class Incident:
    """A decision other than `done`, or an in-process restart, and its cost. `reached`: the step every rank had
    completed before it (the history); `resumed_from`: the step the ranks restored after it; `recovered_at`: the time
    of the first history point above `resumed_from` (before the next incident), `recovery_s` from `mark.time`."""
    mark: Mark
    action: str
    cause: str
    reason: str
    reached: int | None
    resumed_from: int | None
    steps_lost: int
    recovered_at: float | None

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered_at is None else round(self.recovered_at - self.mark.time, 3)

    def line(self) -> str:
        """The incident in words: what, the step reached and resumed from, the steps lost, the recovery."""
        before = f"every rank had reported step {self.reached}, " if self.reached is not None else ""
        resumed = f"resumed from step {self.resumed_from}" if self.resumed_from is not None else "no restore recorded"
        back = f"recovered in {self.recovery_s:.1f} s" if self.recovery_s is not None else "no step after it"
        return f"{self.mark.label}: {before}{resumed}, {self.steps_lost} step(s) lost, {back}"


@dataclass(frozen=True)
class Summary:
    """What `hpcft report` says of a job directory. Rates are measurements: `rate` the steps trained over the wall
    time (the first `start` to the last record, queue waits of a requeue included), `best_rate` the fastest stretch of
    the history between incidents (from its second point: a launch's start-up left out)."""
    job_dir: Path
    job: str
    start: float | None
    end: float | None
    runs: int
    first_step: int  # the step the first launch resumed from (0 on a fresh run)
    steps: int | None  # the step every rank had completed last
    history: list[tuple[float, int]]
    incidents: list[Incident]
    marks: list[Mark]  # faults said by events without a decision of their own (node_bad, agents_restart, …)
    summaries: list[dict[str, Any]] = field(default_factory=list)  # each run's `summary` event's fields

    @property
    def wall_s(self) -> float:
        return 0.0 if self.start is None or self.end is None else round(self.end - self.start, 3)

    @property
    def steps_lost(self) -> int:
        return sum(i.steps_lost for i in self.incidents)

    @property
    def rate(self) -> float | None:
        """Steps per second over the run's wall time."""
        done = (self.steps or 0) - self.first_step
        return round(done / self.wall_s, 4) if self.wall_s > 0 and done > 0 else None

    @property
    def best_rate(self) -> float | None:
        """Steps per second of the fastest stretch between incidents."""
        cuts = [i.mark.time for i in self.incidents]
        return max((r for r in map(_rate, _stretches(self.history, cuts)) if r is not None), default=None)

    @property
    def goodput(self) -> float | None:
        """`rate` / `best_rate`: the share of the wall time the run trained at its best pace."""
        return round(self.rate / self.best_rate, 4) if self.rate and self.best_rate else None

    def as_dict(self) -> dict[str, Any]:
        """One JSON object (`hpcft report --json`)."""
        return {"job_dir": str(self.job_dir), "job": self.job, "start": self.start, "end": self.end,
                "wall_s": self.wall_s, "runs": self.runs, "first_step": self.first_step, "steps": self.steps,
                "steps_lost": self.steps_lost, "rate": self.rate, "best_rate": self.best_rate,
                "goodput": self.goodput,
                "incidents": [{"time": i.mark.time, "label": i.mark.label, "kind": i.mark.kind, "action": i.action,
                               "cause": i.cause, "reason": i.reason, "reached": i.reached,
                               "resumed_from": i.resumed_from, "steps_lost": i.steps_lost,
                               "recovered_at": i.recovered_at, "recovery_s": i.recovery_s} for i in self.incidents],
                "marks": [vars(m) for m in self.marks], "summaries": self.summaries,
                "history": [list(p) for p in self.history]}


def read(job_dir: str | os.PathLike) -> Summary:
    """The account of the run(s) in `job_dir` (during the run too: what is recorded so far)."""
    job_dir = Path(job_dir)
    records = sorted(events.read(job_dir), key=lambda e: e.get("time", 0))
    points = progress.history(job_dir)
    starts = [e for e in records if e.get("event") == "start"]
    times = [e["time"] for e in records if "time" in e] + [t for t, _ in points]
    found = [_incident(e) for e in records if _is_incident(e)]
    bounds = [m.time for m, _ in found][1:] + [float("inf")]
    incidents = [_costed(mark, e, records, points, until) for (mark, e), until in zip(found, bounds)]
    first = found[0][0].time if found else float("inf")
    return Summary(job_dir=job_dir, job=str(starts[0].get("job", job_dir.name)) if starts else job_dir.name,
                   start=starts[0]["time"] if starts else min(times, default=None), end=max(times, default=None),
                   runs=len(starts), first_step=_restored(records, 0.0, first) or 0,
                   steps=points[-1][1] if points else None, history=points, incidents=incidents,
                   marks=[_fault(e) for e in records if e.get("event") in FAULTS],
                   summaries=[{k: v for k, v in e.items() if k not in _META} for e in records
                              if e.get("event") == "summary"])


def _is_incident(e: dict[str, Any]) -> bool:
    return (e.get("event") == "decision" and e.get("action") != "done") or \
        (e.get("event") == "inprocess_restart" and e.get("rank") == 0)  # one event per rank: rank 0's stands


def _incident(e: dict[str, Any]) -> tuple[Mark, dict[str, Any]]:
    """The incident's mark: a decision at its time, an in-process restart at its fault's (total_s before)."""
    if e["event"] == "decision":
        nodes = f" {e['bad_nodes']}" if e.get("bad_nodes") else ""
        return Mark(e["time"], f"{e['action']} ({e.get('cause')}{nodes})", KINDS.get(e.get("cause"), "other")), e
    return Mark(e["time"] - float(e.get("total_s") or 0), f"in-process restart ({e.get('cause')})", "inprocess"), e


def _costed(mark: Mark, e: dict[str, Any], records: Sequence[dict], points: Sequence[tuple[float, int]],
            until: float) -> Incident:
    """`e`'s incident with its cost, read from what happened between its mark and the next incident (`until`)."""
    before = [s for t, s in points if t <= mark.time]
    reached = before[-1] if before else None
    lost = next((r for r in records if r.get("event") == "progress_lost" and mark.time <= r["time"] < until), None)
    if e["event"] == "inprocess_restart":  # rank 0's restore in its process
        resumed = None if e.get("step") is None else int(e["step"])
    else:
        resumed = int(lost["resumed_from"]) if lost else _restored(records, mark.time, until)
    after = [(t, s) for t, s in points if mark.time < t < until]
    if resumed is None and after:  # no restore recorded (a job without the Checkpointer): the history's drop says
        resumed = min(after[0][1], reached) if reached is not None else after[0][1]
    steps_lost = int(lost["steps_lost"]) if lost else max(0, (reached or 0) - resumed) if resumed is not None else 0
    recovered = next((t for t, s in after if resumed is not None and s > resumed), None)
    return Incident(mark, str(e.get("action", "inprocess")), str(e.get("cause", "")), str(e.get("reason", "")),
                    reached, resumed, steps_lost, recovered)


def _restored(records: Sequence[dict], since: float, until: float) -> int | None:
    """The step the ranks restored between `since` and `until`: the lowest `restore_done`, 0 after `restore_none`."""
    steps = [0 if r["event"] == "restore_none" else int(r["step"]) for r in records
             if r.get("event") in ("restore_done", "restore_none") and since <= r.get("time", 0) < until]
    return min(steps, default=None)


def _fault(e: dict[str, Any]) -> Mark:
    """A fault event's mark, labelled with the node (or the meaning) it names."""
    what = e.get("node") or e.get("nodes") or e.get("meaning") or ""
    return Mark(e["time"], f"{e['event']} {what}".strip(), FAULTS[e["event"]])


def _stretches(points: Sequence[tuple[float, int]], cuts: Sequence[float]) -> list[list[tuple[float, int]]]:
    """The history cut at each of `cuts` (the incidents' times)."""
    out: list[list[tuple[float, int]]] = [[]]
    bounds = iter(sorted(cuts) + [float("inf")])
    cut = next(bounds)
    for t, s in points:
        while t > cut:
            out.append([])
            cut = next(bounds)
        out[-1].append((t, s))
    return out


def _rate(stretch: Sequence[tuple[float, int]]) -> float | None:
    """Steps per second from a stretch's second point to its last (its first may be a launch's rebuilt step)."""
    if len(stretch) < 3 or stretch[-1][0] <= stretch[1][0] or stretch[-1][1] <= stretch[1][1]:
        return None
    return round((stretch[-1][1] - stretch[1][1]) / (stretch[-1][0] - stretch[1][0]), 4)
