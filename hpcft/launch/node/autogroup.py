"""A session's CPU priority against its machine's other sessions, lowered and given back, so that a spare's warm standby
does not slow the active nodes' import where they share cores. Linux schedules a session as one group (autogroup,
sched(7)): a plain nice yields only within it and cannot be undone unprivileged; the autogroup's does both."""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

_log = logging.getLogger(__name__)
PATH = Path("/proc/self/autogroup")
TRIES = 20  # the kernel takes one unprivileged change per 0.1 s, machine-wide (EAGAIN meanwhile)


def current(path: Path = PATH) -> int | None:
    """This session's autogroup nice (`/autogroup-N nice K`), or None where there is no such file."""
    try:
        return int(path.read_text().split("nice")[1])
    except (OSError, ValueError, IndexError):
        return None


def _set(path: Path, nice: int) -> bool:
    for _ in range(TRIES):
        try:
            path.write_text(str(nice))
            return True
        except BlockingIOError:
            time.sleep(0.11)
        except OSError as exc:
            _log.info("cannot set the autogroup nice to %d: %s", nice, exc)
            return False
    return False


class Lowered:
    """The session's nice while lowered; `restore()` (idempotent, from any thread) gives the old one back."""

    def __init__(self, path: Path, before: int, nice: int):
        self.path, self.before, self.nice = path, before, nice
        self.since = time.monotonic()
        self.held_s: float | None = None  # how long it stayed lowered, once restored
        self._lock = threading.Lock()

    def restore(self) -> None:
        with self._lock:
            if self.held_s is not None:
                return
            self.held_s = time.monotonic() - self.since
            if not _set(self.path, self.before):
                _log.warning("could not restore the autogroup nice %d (it stays %d)", self.before, self.nice)


def lower(nice: int = 19, path: Path = PATH) -> Lowered | None:
    """Lower this session to autogroup nice `nice`; None (unchanged) without autogroups, if that low, or refused."""
    before = current(path)
    if before is None or before >= nice or not _set(path, nice):
        return None
    return Lowered(path, before, nice)
