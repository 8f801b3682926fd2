"""Progress lost across a launch: the newest step every rank had completed when the previous launch ended (the live
view's `reached`, read then: a rebuilt node later reports an older step) against the step the ranks restored. A loss
must never pass for a success (docs/reference/supervisor.md, "Lost progress")."""
from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hpcft import events
from hpcft.launch.fabric.liveview import Rounds


@dataclass(frozen=True)
class Loss:
    reached: int        # the newest snapshot step every rank had completed before the failure
    resumed_from: int   # the step the next launch's ranks restored (0: nothing, a restart from scratch)
    reason: str         # why the launch happened, and why it could not resume from `reached`

    @property
    def steps_lost(self) -> int:
        return self.reached - self.resumed_from

    def line(self) -> str:
        """The summary's line for this loss."""
        return (f"{self.steps_lost} step(s) lost: resumed from step {self.resumed_from} after step {self.reached} "
                f"had been reached" + (f" ({self.reason})" if self.reason else ""))


def loss(reached: int | None, resumed_from: int | None, reason: str) -> Loss | None:
    """The one count of lost progress, on every path: the steps the trainers had reached before a failure minus the
    step the next launch resumed from. None when nothing was lost, or either step is unknown."""
    if reached is None or resumed_from is None or resumed_from >= reached:
        return None
    return Loss(reached, resumed_from, reason)


def steps_lost(lost: Sequence[Loss]) -> int:
    return sum(x.steps_lost for x in lost)


def exit_status(code: int, lost: Sequence[Loss], lost_exit: int) -> int:
    """`hpcft run`'s exit status: `lost_exit` (--lost-progress-exit; 0: off) for a run that otherwise succeeded but
    lost steps on the way, so that it cannot pass for a clean success; any other status as it is."""
    return lost_exit if code == 0 and lost_exit and steps_lost(lost) else code


@dataclass
class PreviousRun:
    """A requeued run's or a successor's word on the supervisor before it, lost with its node (the batch host, or an
    earlier successor's): said at its start (`previous_run`) and in its summary, with what it cost once the first
    launch's ranks have restored."""
    node: str
    state: str
    reached: int | None  # the step the previous run's trainers had reached (the log it left)
    silent_s: float | None = None  # how long its supervisor had been silent when a janitor acted
    resumed: int | None = None  # the step this run's trainers resumed from
    how: str = "requeue"  # what the janitor did: "requeue" the job, or "takeover" in the same allocation

    @classmethod
    def lost_batch_host(cls, records: Sequence[dict], reached: int | None) -> PreviousRun | None:
        """The previous supervisor, if a janitor requeued the job or took over for its lost node (`batch_host_lost`
        after its `start`; `records`: the job's events, oldest first, read before this run's own `start`)."""
        for record in reversed(records):
            if record.get("event") == "start":
                return None
            if record.get("event") == "batch_host_lost" and record.get("action") in ("requeue", "takeover"):
                return cls(str(record.get("node", "?")), str(record.get("state", "?")), reached,
                           record.get("silent_s"), how=str(record["action"]))
        return None

    def what(self) -> str:
        if self.how == "takeover":
            return f"the supervisor's node {self.node} was lost ({self.state}), and hpcft run with it"
        return f"the previous run lost its batch host {self.node} ({self.state}), and hpcft run with it"

    def reason(self) -> str:
        """The start's word: what happened, and what the run resumes from."""
        reached = f"its trainers had reached step {self.reached}; " if self.reached is not None else ""
        silent = f" after {self.silent_s} s of silence" if self.silent_s is not None else ""
        acted = ("a janitor took the supervision over in the same allocation" if self.how == "takeover"
                 else "its janitors requeued the job")
        return (f"{self.what()}: {acted}{silent}; {reached}this run resumes from what the other nodes hold (event "
                "progress_lost says what is lost)")

    def summary(self) -> str:
        """The summary's word: what happened and what it cost (losses.loss, as every other loss)."""
        if self.resumed is None:
            return f"{self.what()}; this run's trainers never resumed"
        cost = loss(self.reached, self.resumed, "")
        return f"{self.what()}; " + (cost.line() if cost else f"no step lost: resumed from step {self.resumed}")


class RestoreWatch:
    """One launch's restore, read from the job's events.jsonl as the ranks record it (incrementally: only the
    lines written since the last poll are read). `poll` returns the Loss once known, or None; `reached_after` is
    what the trainers had reached when the launch ended (the next launch's `before`): the live view's progress, or
    the newest step the agents protected after the restore if newer (progress reaches the view up to a second late;
    a step protected everywhere is one every rank committed)."""

    def __init__(self, job_dir: str | os.PathLike, world: int, *, since: float, before: int | None, reason: str):
        self.path = Path(job_dir) / "events.jsonl"
        self.world, self.since, self.before, self.reason = world, since, before, reason
        self._tail = events.Tail(self.path, start=self.path.stat().st_size if self.path.exists() else 0, lenient=True)
        self._restored: dict[int, int] = {}
        self.resumed: int | None = None  # the step every rank restored (the lowest), once each has
        self.protected: int | None = None  # the newest step protected on every node since then
        self._restored_at = 0.0  # when the last rank restored
        self.done = False  # the loss, if any, has been returned

    def poll(self) -> Loss | None:
        """The launch's loss once every rank restored (or one found nothing); at most once, None for no loss."""
        self._read()
        if self.done or self.resumed is None:
            return None
        self.done = True
        return loss(self.before, self.resumed, self.reason)

    def reached_after(self, view: int | None) -> int | None:
        """What the trainers had reached when the launch ended, `view` being the live view's `reached` then: a
        launch whose ranks never all restored advanced nothing, and the step `before` it stands."""
        self._read()
        if self.resumed is None:
            return self.before
        return max(s for s in (self.resumed, view, self.protected) if s is not None)

    def say(self, emit: Callable[..., None], lost: list[Loss]) -> None:
        """Add the loss to `lost` and say it once (`progress_lost`, ERROR after a restart from step 0)."""
        found = self.poll()
        if found is None:
            return
        lost.append(found)
        emit("progress_lost", level=logging.ERROR if found.resumed_from == 0 else logging.WARNING,
             reached=found.reached, resumed_from=found.resumed_from, steps_lost=found.steps_lost, reason=found.reason)

    def _read(self) -> None:
        for record in self._tail.new():
            when, what = record.get("time", 0), record.get("event")
            if when < self.since:
                continue
            if self.resumed is not None:
                # the summed record: every node protected the step, after the restore (a kept agent's pass over the
                # last launch's step may end, and reach this file, after it)
                if what == Rounds.KIND and when >= self._restored_at:
                    self.protected = max(int(record["step"]), self.protected or 0)
                continue
            if what == "restore_none" and "rank" in record:  # the ranks' agreement gives step 0 to all of them
                self._restored = {r: 0 for r in range(self.world)}
            elif what == "restore_done" and "rank" in record:
                self._restored.setdefault(int(record["rank"]), int(record["step"]))
            else:
                continue
            self._restored_at = max(self._restored_at, when)
            if len(self._restored) >= self.world:
                self.resumed = min(self._restored.values())
