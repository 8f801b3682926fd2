"""The `inprocess_restart` event of a restarted rank: the wrapper opens it at the restart barrier,
`Checkpointer.restore()` adds the step restored and emits it (the wrapper, without a step, if none is).
Torch-free: the Checkpointer imports it cheaply."""
from __future__ import annotations

import logging
import time
from typing import Any

from hpcft import events

_pending: dict[str, Any] | None = None
_marks: dict[str, float] = {}


def expect(fields: dict[str, Any], marks: dict[str, float]) -> None:
    """A restart is under way: `fields` go into its event; `marks` are wall-clock times of its phases so far."""
    global _pending
    _pending = dict(fields)
    _marks.clear()
    _marks.update(marks)


def mark(name: str) -> None:
    """The time a phase of the restart ended (e.g. "groups": the new process groups are made)."""
    if _pending is not None:
        _marks[name] = time.time()


def restored(step: int | None) -> dict | None:
    """Emit the pending restart's event with the step its generation restored (None: nothing). Cleared only after the
    emit: should a peer's fault interrupt it, the wrapper emits what is still pending."""
    global _pending
    if _pending is None:
        return None
    _marks["restored"] = time.time()
    order = [k for k in ("fault", "noticed", "torn_down", "barrier", "groups", "restored") if k in _marks]
    phases = {f"{b}_s": round(_marks[b] - _marks[a], 6) for a, b in zip(order, order[1:])}
    said = events.emit("inprocess_restart", level=logging.WARNING, **_pending, step=step, **phases,
                       total_s=round(_marks["restored"] - _marks.get("fault", _marks["restored"]), 6))
    _pending = None
    return said


def pending() -> bool:
    return _pending is not None
