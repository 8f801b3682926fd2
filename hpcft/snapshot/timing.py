"""A rank's own share of each step, for the supervisor's straggler detector (docs/reference/supervisor.md,
"Stragglers"): `ready_s` of step s runs from step s-1's optimizer boundary (where the data-parallel ranks left the
gradient collective together) to this rank's last gradient accumulation of step s, before it waits for its peers:
unlike the step's wall time, a slow rank's grows alone. Without gradient hooks (FSDP2's sharded parameters) it ends at
the pre-step hook, wait included. Marks are CUDA events on a GPU (the CPU's clock would time the enqueueing)."""
import time
from collections.abc import Callable
from typing import Any

import torch


class CpuClock:
    """Marks are perf_counter seconds: always resolved."""

    def mark(self, again: Any = None) -> Any:
        return time.perf_counter()

    def elapsed(self, start: Any, end: Any) -> float | None:
        return end - start


class CudaClock:
    """Marks are CUDA events recorded on the current stream; a pair resolves once the later one has completed."""

    def mark(self, again: Any = None) -> Any:
        """A new event, or `again` recorded anew (a step's gradient mark moves with each accumulation)."""
        event = again if again is not None else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed(self, start: Any, end: Any) -> float | None:
        if not end.query():
            return None  # the device is still behind: resolved at a later boundary
        return start.elapsed_time(end) / 1000.0


def clock_for(device: torch.device) -> CpuClock | CudaClock:
    return CudaClock() if device.type == "cuda" else CpuClock()


class StepTimer:
    """The marks of each step (`started` after the optimizer boundary, `grads` at every gradient accumulation,
    `ended` before the next optimizer step) and what the snapshot reports: the mean `ready_s` since the last one."""

    def __init__(self, clock: CpuClock | CudaClock):
        self.clock = clock
        self._start: Any = None
        self._grad: Any = None
        self._open: list[tuple[Any, Any]] = []  # closed steps whose marks have not resolved yet
        self._done: list[float] = []

    def started(self) -> None:
        self._start, self._grad = self.clock.mark(), None

    def grad(self, *_: Any) -> None:
        if self._start is not None:
            self._grad = self.clock.mark(self._grad)

    def ended(self) -> None:
        if self._start is None:
            return  # the first step of a launch: no boundary before it
        self._open.append((self._start, self._grad if self._grad is not None else self.clock.mark()))
        self._start = self._grad = None

    def report(self) -> dict[str, float | int] | None:
        """{"ready_s": mean, "steps": n} over the steps resolved since the last report, or None when none has."""
        still = []
        for start, end in self._open:
            took = self.clock.elapsed(start, end)
            (still.append((start, end)) if took is None else self._done.append(took))
        self._open = still[-8:]  # a device far behind: keep the newest few
        if not self._done:
            return None
        out = {"ready_s": round(sum(self._done) / len(self._done), 6), "steps": len(self._done)}
        self._done = []
        return out


def grad_hooks(model: torch.nn.Module, hook: Callable[..., None]) -> list[Any]:
    """`hook` after each gradient accumulation of `model`'s trainable parameters; the handles. A parameter that takes
    no such hook (a tensor subclass) is left out."""
    handles = []
    for p in model.parameters():
        if p.requires_grad:
            try:
                handles.append(p.register_post_accumulate_grad_hook(hook))
            except (RuntimeError, AttributeError, TypeError):
                continue
    return handles
