"""A bytes-per-second cap for protection traffic, so the agent never starves the trainers of bandwidth."""
from __future__ import annotations

import time
from collections.abc import Callable

from hpcft.errors import ConfigError


class Throttle:
    """Token bucket: `take(n)` sleeps until n bytes fit under `rate` bytes/s (burst `burst` bytes).
    A rate of 0 or None means no cap; the default burst is a tenth of a second's worth (64 KiB to 4 MiB)."""

    def __init__(self, rate: float | None, burst: int | None = None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        self.rate = rate or 0.0
        self.burst = burst if burst is not None else int(min(4 << 20, max(64 << 10, self.rate / 10)))
        self._clock, self._sleep = clock, sleep
        self._tokens = float(self.burst)
        self._last = clock()

    def take(self, nbytes: int) -> None:
        """Account for `nbytes` about to be sent or encoded; wait as long as the cap requires."""
        if self.rate <= 0:
            return
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate) - nbytes
        self._last = now
        if self._tokens < 0:
            self._sleep(-self._tokens / self.rate)


def pace(nbytes: float, seconds: float, fill: float = 0.8) -> float:
    """The cap that spreads `nbytes` of paced work (checksums + sends of one protect pass) over `fill` of an
    interval of `seconds` (the snapshot interval): protection finishes before the next snapshot without bursts."""
    if nbytes <= 0 or seconds <= 0 or not 0 < fill <= 1:
        raise ConfigError(f"pace needs bytes > 0, seconds > 0, 0 < fill <= 1 (got {nbytes}, {seconds}, {fill})")
    return nbytes / (fill * seconds)
