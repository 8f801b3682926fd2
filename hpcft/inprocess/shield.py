"""Training-thread sections an in-process restart's interrupt must not cut in two: a snapshot's start and the copy's
guard (cut there, the step's snapshot is lost on this rank alone). The watcher's interrupt (an asynchronous exception)
lands at the section's end instead; NCCL/RCCL communicators are still aborted at once. No locks (an asynchronous
exception can land inside a lock's `with`): the threads meet through single dict operations, atomic under the GIL,
and whichever side pops the deferred interrupt fires it, once. A delivery that finds no section open fires at once
even if one opens a few bytecodes later: the window is that narrow, not closed."""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_depth: dict[int, int] = {}  # thread ident -> sections entered
_deferred: dict[int, Callable[[], None]] = {}  # thread ident -> its interrupt, waiting for the section's end


def enter() -> None:
    """Open a section on this thread (one spanning two calls, e.g. the optimizer's hooks); `leave()` closes it."""
    tid = threading.get_ident()
    _depth[tid] = _depth.get(tid, 0) + 1


def leave() -> None:
    """Close this thread's innermost section; leaving the outermost fires an interrupt parked meanwhile."""
    tid = threading.get_ident()
    left = _depth[tid] - 1
    if left:
        _depth[tid] = left
        return
    del _depth[tid]
    fire = _deferred.pop(tid, None)
    if fire is not None:
        fire()


@contextmanager
def section() -> Iterator[None]:
    """Run the block with interrupts aimed at this thread deferred to its end (nested sections: the outermost)."""
    enter()
    try:
        yield
    finally:
        leave()


def deliver(tid: int, fire: Callable[[], None]) -> bool:
    """From another thread: interrupt thread `tid` with `fire()` now, or when it leaves its section; True if fired
    now. The interrupt is parked first and taken back only if no section is open, so one racing with a section's
    end is fired by whichever side pops it."""
    _deferred[tid] = fire
    if tid not in _depth and _deferred.pop(tid, None) is not None:
        fire()
        return True
    return False


def cancel(tid: int) -> None:
    """Drop an interrupt still waiting for `tid`'s section (its generation ended first)."""
    _deferred.pop(tid, None)
