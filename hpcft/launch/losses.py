"""Progress lost across a launch, as the supervisor sees it: the newest snapshot step every rank had completed
before the launch (the supervisor's live view of their progress, hpcft/launch/liveview.py `reached`) against the step the launch's ranks restored
(the Checkpointer's `restore_done` / `restore_none` events in the job directory). A launch that resumes from an
older step lost the steps in between; one that starts from step 0 after progress existed lost everything, which
must never pass for a success (docs/supervisor.md, "Lost progress")."""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path



@dataclass(frozen=True)
class Loss:
    reached: int        # the newest snapshot step every rank had completed before the launch
    resumed_from: int   # the step the launch's ranks restored (0: nothing, a restart from scratch)
    reason: str         # why the launch happened, and why it could not resume from `reached`

    @property
    def steps_lost(self) -> int:
        return self.reached - self.resumed_from

    def line(self) -> str:
        """The summary's line for this loss."""
        return (f"{self.steps_lost} step(s) lost: resumed from step {self.resumed_from} after step {self.reached} "
                f"had been reached ({self.reason})")


class RestoreWatch:
    """One launch's restore, read from the job's events.jsonl as the ranks record it (incrementally: only the
    lines written since the last poll are read). `poll` returns the Loss once known, or None."""

    def __init__(self, job_dir: str | os.PathLike, world: int, *, since: float, before: int | None, reason: str):
        self.path = Path(job_dir) / "events.jsonl"
        self.world, self.since, self.before, self.reason = world, since, before, reason
        self._offset = self.path.stat().st_size if self.path.exists() else 0
        self._restored: dict[int, int] = {}
        self.done = not before  # nothing to lose: no step had been reached

    def poll(self) -> Loss | None:
        """The launch's loss, once every rank restored (or one found nothing to restore); None until then, and
        None for a launch that lost nothing. Returns a loss at most once."""
        if self.done:
            return None
        for record in self._new_records():
            if record.get("time", 0) < self.since or "rank" not in record:
                continue
            if record.get("event") == "restore_none":  # the ranks' agreement gives step 0 to all of them
                self._restored = {r: 0 for r in range(self.world)}
            elif record.get("event") == "restore_done":
                self._restored.setdefault(int(record["rank"]), int(record["step"]))
        if len(self._restored) < self.world:
            return None
        self.done = True
        resumed = min(self._restored.values())
        return Loss(self.before, resumed, self.reason) if resumed < self.before else None

    def say(self, emit: Callable[..., None], lost: list[Loss]) -> None:
        """Say it loudly, once (`progress_lost`, ERROR after a restart from step 0), when the launch's ranks resumed
        from an older step than the one they had reached; the loss is added to `lost` (the run's summary)."""
        loss = self.poll()
        if loss is None:
            return
        lost.append(loss)
        emit("progress_lost", level=logging.ERROR if loss.resumed_from == 0 else logging.WARNING,
             reached=loss.reached, resumed_from=loss.resumed_from, steps_lost=loss.steps_lost, reason=loss.reason)

    def _new_records(self) -> list[dict]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1  # a line being written is read whole at the next poll
        self._offset += end
        records = []
        for line in data[:end].splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
        return records
