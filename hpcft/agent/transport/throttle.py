"""Caps on protection work: bytes per second and CPU cores (the node's are the trainers'). The CPU cap bills protection
only: billed at 1 % of a core, the agent's chores (heartbeats, reports, pin renewals; threads made by `chore`) left
nothing for protection, and one flush commit's 1.9 CPU-s of torch import stopped it for 190 s."""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

from hpcft.errors import ConfigError

CPU_SHARE = 0.01  # the agent's default CPU cap: 1 % of the node's cores (docs/reference/protection.md, Cost)
_chores: dict[int, int] = {}  # thread id -> its CPU clock, for the chores running now
_chores_done = [0.0]  # CPU seconds of the chores that have ended, and of `unbilled` work
_chores_lock = threading.Lock()


def chore(target: Callable[..., None], *args: object, name: str) -> threading.Thread:
    """A daemon thread (not started) running `target(*args)` whose CPU the cap does not bill (see module doc)."""
    def run() -> None:
        ident = threading.get_ident()
        with _chores_lock:
            _chores[ident] = time.pthread_getcpuclockid(ident)
        try:
            target(*args)
        finally:
            with _chores_lock:
                del _chores[ident]
                _chores_done[0] += time.thread_time()
    return threading.Thread(target=run, name=name, daemon=True)


@contextmanager
def unbilled() -> Iterator[None]:
    """Work on this thread that the CPU cap does not bill (slot 0's commit of a flush, on the rounds' thread)."""
    start = time.thread_time()
    try:
        yield
    finally:
        with _chores_lock:
            _chores_done[0] += time.thread_time() - start


def billed_cpu() -> float:
    """The process's CPU seconds but its chores' (the CPU cap's clock)."""
    with _chores_lock:
        spent = _chores_done[0]
        for clock in _chores.values():
            with suppress(OSError):  # ended between its last line and its finally
                spent += time.clock_gettime(clock)
        return time.process_time() - spent


class Throttle:
    """Token buckets: `take(n)` sleeps until n bytes fit under `rate` bytes/s (default burst: a tenth of a second's,
    64 KiB to 4 MiB) and the process's CPU time under `cpu` cores on average (burst: a second's); 0 or None: no cap.
    `release()` ends a sleep under way: at 0.01 cores a pass's debt of 1 CPU-s was a 100 s sleep that a persist (the
    trainers stopped, waiting) sat through."""

    def __init__(self, rate: float | None, burst: int | None = None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], object] | None = None, cpu: float | None = None,
                 cpu_clock: Callable[[], float] = billed_cpu):
        self.rate = rate or 0.0
        self.cpu = cpu or 0.0
        self.burst = burst if burst is not None else int(min(4 << 20, max(64 << 10, self.rate / 10)))
        self._lifted = threading.Event()  # set by `release`: wakes a `take` sleeping off its debt
        self._clock, self._sleep, self._cpu_clock = clock, sleep or self._lifted.wait, cpu_clock
        self._tokens = float(self.burst)
        self._cpu_tokens = self.cpu
        self._last = clock()
        self._cpu_last = cpu_clock()
        self._released = False

    def release(self) -> None:
        """Lift both caps for good (nothing left to spare: the trainers have stopped), a sleep under way included."""
        self._released = True
        self.rate = self.cpu = 0.0
        self._lifted.set()

    @contextmanager
    def uncapped(self) -> Iterator[None]:
        """Work the trainers wait on, which the CPU cap neither slows nor bills (at 1 % of a core a rebuild's 30 ms of
        CPU cost 3 s of recovery); the byte cap still holds. Both accounts start afresh after it."""
        cpu, self.cpu = self.cpu, 0.0
        try:
            yield
        finally:
            if not self._released:
                self.cpu = cpu
            self.forgive()

    def forgive(self) -> None:
        """Start the accounts afresh: nothing spent so far counts, both buckets full."""
        self._last, self._cpu_last = self._clock(), self._cpu_clock()
        self._tokens, self._cpu_tokens = float(self.burst), self.cpu

    def take(self, nbytes: int) -> None:
        """Account for `nbytes` about to be sent or encoded; wait as long as the caps require."""
        if self.rate <= 0 and self.cpu <= 0:
            return
        now = self._clock()
        elapsed, self._last = now - self._last, now
        wait = 0.0
        if self.rate > 0:
            self._tokens = min(self.burst, self._tokens + elapsed * self.rate) - nbytes
            wait = max(wait, -self._tokens / self.rate)
        if self.cpu > 0:
            cpu_now = self._cpu_clock()
            used, self._cpu_last = cpu_now - self._cpu_last, cpu_now
            # net of the allowance accrued meanwhile: CPU spent between passes (rounds, status) is no debt if it
            # stayed under the cap; unused allowance is kept only up to the burst
            self._cpu_tokens = min(self.cpu, self._cpu_tokens + elapsed * self.cpu - used)
            wait = max(wait, -self._cpu_tokens / self.cpu)
        if wait > 0:
            self._sleep(wait)


def cpu_cores(share: float, cores: float | None = None) -> float:
    """The agent's CPU cap in cores: `cores` when given, else `share` of the cores this process may run on."""
    if cores is not None:
        if cores < 0:
            raise ConfigError(f"cpu_cores is a number of cores, 0 or more (got {cores})")
        return cores
    if not 0 <= share <= 1:
        raise ConfigError(f"a CPU share is a fraction of the node's cores between 0 and 1 (got {share})")
    return share * len(os.sched_getaffinity(0))

