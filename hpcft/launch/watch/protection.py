"""The supervisor's protection watch: the agents' newest protected step (every node's) against the trainers' step.
Protection that stops advancing while the trainers go on loses nothing yet, but a node lost then costs every step
since, and nothing else says so: event `protect_stalled` (ERROR) once per stall past STALL_S, `protect_resumed` when
it ends, and each stall a line of the run's summary (`protection_stalled=`)."""
import logging
import time
from collections.abc import Callable

STALL_S = 120.0  # protection not advanced for this long while the trainers went on (a flush of a large model pauses
# it for tens of seconds: the agents pin what they write)
BEHIND = 2  # steps past the protected one before a stall counts: the step in flight is never protected


class ProtectionWatch:
    """One per run; `launched` starts each launch's watch afresh, `poll` judges."""

    def __init__(self, emit: Callable[..., None], stall_s: float = STALL_S):
        self.emit, self.stall_s = emit, stall_s
        self._said: list[str] = []  # each stall, for the run's summary
        self.stalled: float | None = None  # when the ongoing stall was said
        self.launched(0.0)

    def launched(self, now: float | None = None) -> None:
        """A new launch: its agents protect from scratch; its trainers' first step seen is where they started."""
        if self.stalled is not None:  # a stall the launch's end cut short
            self._said.append(self._line(time.time() if now is None else now) + " (until the launch ended)")
        self.guarded: int | None = None  # the protected step last seen
        self.since = time.time() if now is None else now  # since when it has not changed
        self.start: int | None = None  # the trainers' first step seen in this launch
        self.stalled = None
        self.reached = 0  # the trainers' step last seen

    def poll(self, protected: int | None, training: int | None, flushing: int = 0, now: float | None = None) -> None:
        """`protected`: every agent's newest protected step (None: not every one has one); `training`: the step every
        rank reached; `flushing`: how many agents are flushing to the durable tier (an explanation, said with it)."""
        now = time.time() if now is None else now
        if training is None:
            return
        if self.start is None:
            self.start = training
        self.reached = training
        if protected != self.guarded:
            if self.stalled is not None:
                self._said.append(self._line(now))
                self.emit("protect_resumed", level=logging.WARNING, protected=protected, was=self.guarded,
                          stalled_s=round(now - self.since, 1))
            self.guarded, self.since, self.stalled = protected, now, None
            return
        behind = training - (self.start if protected is None else protected)
        if self.stalled is None and behind >= BEHIND and now - self.since > self.stall_s:
            self.stalled = now
            self.emit("protect_stalled", level=logging.ERROR, protected=protected, training=training, behind=behind,
                      stalled_s=round(now - self.since, 1), flushing=flushing,
                      meaning=f"a node lost now loses the {behind} steps since the newest protected one",
                      advice="see the agents' events (protect_*, flush_*) and `hpcft status`")

    def _line(self, now: float) -> str:
        at = "no step" if self.guarded is None else f"step {self.guarded}"
        return f"at {at} for {now - self.since:.0f} s while the trainers reached {self.reached}"

    def summary(self) -> dict[str, str]:
        """The summary's `protection_stalled=` field, when protection stalled (an ongoing stall too)."""
        lines = self._said + ([self._line(time.time()) + " (unresolved)"] if self.stalled else [])
        return {"protection_stalled": "; ".join(lines)} if lines else {}
