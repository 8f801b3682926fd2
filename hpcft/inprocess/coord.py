"""The job's coordination store for in-process restarts: one TCPStore on the rendezvous address (served by rank 0),
kept across generations: each generation's first fault, give-up flag, restart and completion barriers, and groups."""
from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from hpcft.inprocess.policy import barrier_outcome

_log = logging.getLogger(__name__)
POLL_S = 0.01  # barrier polls: a few round trips to rank 0 while every rank is stopped anyway
STALL_S = 0.5  # a barrier still short of ranks after this: maybe blocked on this rank's unfreed groups


class Coord:
    """Keys (g: generation): `f/g` faults counted, `f/g/first` the first one's record, `x/g` a give-up reason,
    `b/g` ranks arrived for generation g, `d/g` ranks done in g, `pg/g/...` generation g's process groups."""

    def __init__(self, host: str, port: int, rank: int, world: int, timeout_s: float):
        self.rank, self.world = rank, world
        self.store = dist.TCPStore(host, port, world, rank == 0, wait_for_workers=False,
                                   timeout=timedelta(seconds=timeout_s))

    def group_store(self, gen: int) -> dist.Store:
        """Where generation `gen`'s process groups rendezvous (a fresh prefix: nothing of the old groups is read)."""
        return dist.PrefixStore(f"pg/{gen}/", self.store)

    def publish_fault(self, gen: int, cause: str, when: float) -> dict:
        """Count this rank's fault in `gen`; the first one also leaves its record. Returns the first fault's record."""
        if self.store.add(f"f/{gen}", 1) == 1:
            self.store.set(f"f/{gen}/first", json.dumps({"rank": self.rank, "cause": cause, "t": when}))
        return self.first_fault(gen)

    def first_fault(self, gen: int) -> dict:
        """The first fault of `gen` (waits for its record, which its rank writes right after counting it)."""
        return json.loads(self.store.get(f"f/{gen}/first"))

    def faulted(self, gen: int) -> bool:
        return self.store.check([f"f/{gen}"])

    def give_up(self, gen: int, reason: str) -> None:
        self.store.set(f"x/{gen}", f"rank {self.rank}: {reason}")

    def gave_up(self, gen: int) -> str | None:
        return self.store.get(f"x/{gen}").decode() if self.store.check([f"x/{gen}"]) else None

    def barrier(self, gen: int, timeout_s: float, on_stall: Callable[[], None] = lambda: None,
                clock: Callable[[], float] = time.monotonic) -> str:
        """Arrive for generation `gen` and wait for every rank: "go", or why to give up (policy.barrier_outcome);
        `on_stall()` once if the others are not all there within STALL_S."""
        arrived = self.store.add(f"b/{gen}", 1)
        t0, stalled = clock(), False
        while True:
            outcome = barrier_outcome(arrived, self.world, clock() - t0, timeout_s, self.gave_up(gen - 1))
            if outcome is not None:
                return outcome
            if not stalled and clock() - t0 > STALL_S:
                stalled = True
                on_stall()
            time.sleep(POLL_S)
            arrived = self.store.add(f"b/{gen}", 0)

    def finish(self, gen: int, timeout_s: float) -> bool:
        """This rank completed generation `gen`: wait until every rank has (True) or one of them faulted in it
        (False: this rank joins the restart). Rank 0 serves the store, so no rank leaves before all are done."""
        self.store.add(f"d/{gen}", 1)
        deadline = time.monotonic() + timeout_s
        while self.store.add(f"d/{gen}", 0) < self.world:
            # the key also appears when the last rank finished (below, to wake the watchers): a fault only if some
            # rank is still not done once it is seen (a faulted rank never counts itself done)
            if self.faulted(gen) and self.store.add(f"d/{gen}", 0) < self.world:
                return False
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {self.store.add(f'd/{gen}', 0)} of {self.world} ranks finished within "
                                   f"{timeout_s:g} s of this one")
            time.sleep(POLL_S * 5)
        self.store.add(f"f/{gen}", 0)  # makes the key exist: wakes every watcher (now disarmed) so it can stop
        if self.store.add(f"d/{gen}/left", 1) == self.world:
            self.store.set(f"d/{gen}/all-left", "1")
        if self.rank == 0:  # the store must outlive every rank's last request
            self.store.wait([f"d/{gen}/all-left"], timedelta(seconds=timeout_s))
        return True


class Watcher:
    """A thread that waits (server-pushed, no polling) for the current generation's first fault on its own store
    connection and calls `on_fault(gen)` once per generation; `on_fault(gen)` too if the store is lost (rank 0 gone)."""

    def __init__(self, coord: Coord, on_fault: Callable[[int], None]):
        self._store = coord.store.clone()
        self._on_fault = on_fault
        self._gen = 0
        self._armed = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="hpcft-inprocess-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def arm(self, gen: int) -> None:
        """Watch generation `gen` from now on."""
        self._gen = gen
        self._armed.set()

    def disarm(self) -> None:
        self._armed.clear()

    def stop(self) -> None:
        """End the thread and wait for it (at most its 1 s wait): one left inside a store call at exit aborts the
        process."""
        self._stop = True
        self._armed.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)

    def _run(self) -> None:
        while not self._stop:
            self._armed.wait()
            gen = self._gen
            if self._stop:
                return
            try:
                self._store.wait([f"f/{gen}"], timedelta(seconds=1))
            except Exception as exc:  # noqa: BLE001 - a timeout (wait again) or the store lost
                if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
                    continue
                _log.warning("in-process restart: coordination store lost (%s)", exc)
                self._stop = True
            if self._armed.is_set() and gen == self._gen:
                self._armed.clear()
                self._on_fault(gen)
