"""`hpcft.restartable`: run a training function and, on a fault that leaves the processes alive, restart it in them:
every rank is told through the coordination store, interrupted, tears down its groups, meets the others at a barrier
and runs the function again (fresh groups: `attempt.init`; state restored from node memory). A dead rank, a fault
past `max_restarts` or a barrier timeout ends every rank non-zero (`inprocess_giveup`), so the supervisor relaunches.
See docs/reference/checkpointing.md "In-process restart"."""
from __future__ import annotations

import ctypes
import functools
import gc
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hpcft import events
from hpcft.env import job_env
from hpcft.errors import HpcftError
from hpcft.inprocess import abort, record, shield
from hpcft.inprocess.coord import Coord, Watcher
from hpcft.inprocess.policy import RestartOptions, describe, verdict

_log = logging.getLogger(__name__)


class Interrupted(HpcftError):
    """Raised in a rank's training thread when another rank faulted (the watcher's asynchronous exception)."""


class GaveUp(HpcftError):
    """In-process restart gave up on this fault; the process should exit non-zero so the supervisor relaunches."""


@dataclass
class Attempt:
    """What the training function receives in each generation. `state` is kept across generations (a model and its
    optimizer kept there are restored in place, nothing rebuilt); `cause` is the previous generation's first fault."""
    generation: int
    cause: str | None
    state: dict[str, Any]
    _coord: Coord = field(repr=False)
    _opts: RestartOptions = field(repr=False)

    def init(self, **kwargs: Any) -> Any:
        """hpcft.init() for this generation: its process groups rendezvous under the generation's own prefix."""
        from hpcft.runtime import init

        ctx = init(store=self._coord.group_store(self.generation), timeout_s=self._opts.init_timeout_s, **kwargs)
        record.mark("groups")
        return ctx


def restartable(fn: Callable[[Attempt], Any] | None = None, *, options: RestartOptions | None = None,
                **settings: Any) -> Any:
    """Decorate `fn(attempt)` (or wrap it: `restartable(fn)`); calling the result runs it under in-process restart.
    `settings` are RestartOptions' fields (max_restarts, barrier_timeout_s, init_timeout_s)."""
    opts = options or RestartOptions(**settings)

    def wrap(f: Callable[[Attempt], Any]) -> Callable[[], Any]:
        return functools.wraps(f)(lambda: _Runner(f, opts).run())

    return wrap(fn) if fn is not None else wrap


class _Runner:
    """The generation loop of one process."""

    def __init__(self, fn: Callable[[Attempt], Any], opts: RestartOptions):
        self.fn, self.opts = fn, opts
        env = job_env()
        self.rank, self.world = env.rank, env.world_size
        self.coord = Coord(env.master_addr, env.master_port, env.rank, env.world_size, opts.barrier_timeout_s)
        self.watcher = Watcher(self.coord, self._on_fault)
        self._lock = threading.Lock()
        self._running = False
        self._tid = threading.get_ident()
        self.gen, self.restarts = 0, 0

    def run(self) -> Any:
        state: dict[str, Any] = {}
        cause: str | None = None
        self.watcher.start()
        try:
            while True:
                exc, result = self._generation(Attempt(self.gen, cause, state, self.coord, self.opts))
                if exc is None and self.coord.finish(self.gen, self.opts.init_timeout_s):
                    if record.pending():
                        record.restored(None)
                    return result
                cause = self._recover(exc)
        finally:
            self.watcher.stop()

    def _generation(self, attempt: Attempt) -> tuple[BaseException | None, Any]:
        """Run the function once; (its exception or None, its result)."""
        exc, result = None, None
        with self._lock:
            self._running = True
        self.watcher.arm(self.gen)
        try:
            try:
                result = self.fn(attempt)
            except BaseException as e:  # noqa: BLE001 - every fault is judged by policy.verdict
                exc = e
        except Interrupted as e:  # delivered while handling the first one
            exc = exc or e
        while True:  # leave "running" with no asynchronous exception pending
            try:
                with self._lock:
                    self._running = False
                    shield.cancel(self._tid)
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._tid), None)
                break
            except Interrupted as e:
                exc = exc or e
        self.watcher.disarm()
        return exc, result

    def _on_fault(self, gen: int) -> None:
        """Watcher thread: a rank faulted in `gen` (or the store is lost); interrupt this rank's training thread."""
        with self._lock:
            if not self._running or gen != self.gen:
                return
            abort.interrupt()
            shield.deliver(self._tid, self._interrupt)  # at once, or where a snapshot's start or guard ends

    def _interrupt(self) -> None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._tid), ctypes.py_object(Interrupted))

    def _recover(self, exc: BaseException | None) -> str:
        """After a fault in this generation: publish, tear down, decide, meet at the barrier. Returns the first
        fault's cause for the next generation; raises GaveUp (or the fatal exception) when not restarting."""
        noticed = time.time()
        if record.pending():  # the previous restart's generation faulted before its restore returned
            record.restored(None)
        own = None if exc is None or isinstance(exc, Interrupted) else exc
        mine = describe(own) if own is not None else ("a peer finished after a fault" if exc is None else
                                                       "interrupted for a peer's fault")
        first: dict = {}
        try:
            first = self.coord.publish_fault(self.gen, mine, noticed) if own is not None else \
                self.coord.first_fault(self.gen)
        except Exception as store_exc:  # noqa: BLE001 - rank 0 (the store) is gone: no restart possible
            self._give_up(f"coordination store lost: {describe(store_exc)}", own, exc, publish=False)
        _log.info("in-process restart: rank %d noticed %s (first: %s)", self.rank, mine, first)
        broken = abort.teardown(exc)
        torn = time.time()
        _log.info("in-process restart: rank %d tore down its groups in %.3f s", self.rank, torn - noticed)
        reason = verdict(own, self.restarts, self.opts, self._peer_gave_up())
        if reason is None and broken:
            reason = f"tearing down the process groups failed: {broken}"
        if reason is not None:
            self._give_up(reason, own, exc, first=first)
        outcome = self._barrier()
        if outcome != "go":
            self._give_up(outcome, own, exc, first=first, publish=False)
        fields = {"rank": self.rank, "generation": self.gen + 1, "cause": first.get("cause", mine),
                  "origin_rank": first.get("rank", self.rank), "own": mine, "restarts": self.restarts + 1,
                  "max_restarts": self.opts.max_restarts}
        record.expect(fields, {"fault": first.get("t", noticed), "noticed": noticed, "torn_down": torn,
                               "barrier": time.time()})
        self.gen += 1
        self.restarts += 1
        return fields["cause"]

    def _peer_gave_up(self) -> str | None:
        try:
            return self.coord.gave_up(self.gen)
        except Exception:  # noqa: BLE001 - the store's loss shows at the barrier
            return None

    def _barrier(self) -> str:
        try:
            # a stalled barrier: a peer may wait on this rank's sockets, which groups held in reference cycles keep
            # open; a full collection frees them (≈ 0.5 s with torch loaded: only then)
            return self.coord.barrier(self.gen + 1, self.opts.barrier_timeout_s, on_stall=gc.collect)
        except Exception as exc:  # noqa: BLE001
            return f"coordination store lost at the barrier: {describe(exc)}"

    def _give_up(self, reason: str, own: BaseException | None, exc: BaseException | None, first: dict | None = None,
                 publish: bool = True) -> None:
        """Every rank gives up together: the reason goes to the store (peers stop waiting), the event is an error,
        and the process leaves with GaveUp (chained to this rank's own exception), or with that exception if fatal."""
        if publish:
            try:
                self.coord.give_up(self.gen, reason)
            except Exception:  # noqa: BLE001 - peers then give up at their barrier's timeout
                _log.debug("could not publish the give-up", exc_info=True)
        events.emit("inprocess_giveup", level=logging.ERROR, rank=self.rank, generation=self.gen, reason=reason,
                    cause=(first or {}).get("cause", describe(own) if own else "interrupted"),
                    restarts=self.restarts, max_restarts=self.opts.max_restarts,
                    advice="the process exits non-zero; the supervisor relaunches from the newest snapshot")
        if own is not None and not isinstance(own, Exception):
            raise own
        raise GaveUp(f"in-process restart gave up on rank {self.rank} in generation {self.gen}: {reason}") from exc
