"""A session's CPU priority against its machine's other sessions, lowered and given back, so that a spare's warm standby
does not slow the active nodes' import where they share cores, and a node agent runs below the trainers (`Below`).
Linux schedules a session as one group (autogroup, sched(7)): a plain nice yields only within it and cannot be undone
unprivileged; the autogroup's does both."""
from __future__ import annotations

import logging
import os
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


def own_session(proc: Path = Path("/proc")) -> bool:
    """Whether this process's session is its own to lower: it leads it, or it is an srun task, whose session is its
    step's slurmstepd's (measured on the confined sandbox: each step's tasks share one autogroup, the trainers'
    another). Not a child of a warm standby (which shares its session with the warm ranks) nor of a local parent."""
    if os.getsid(0) == os.getpid():
        return True
    try:
        return (proc / str(os.getppid()) / "comm").read_text().strip() == "slurmstepd"
    except OSError:
        return False


class Below:
    """A helper process scheduled below the trainers: its plain nice raised for good (`nice`; an unprivileged process
    cannot take that back) and, where its session is its own (`own_session`) and Linux groups sessions, that
    session's autogroup at `nice` too, which weighs against the trainers' sessions where the plain nice would not.
    `level()` gives the autogroup's back while the trainers wait on this process (a persist, a lag over its bound);
    `below()` lowers it again. Where there is no autogroup to change, both are no-ops (`said()` tells which)."""

    def __init__(self, nice: int, path: Path = PATH):
        self.nice, self.path = nice, path
        self.own_session = own_session()
        self._lowered: Lowered | None = None
        self._able = nice > 0 and self.own_session  # false once the autogroup could not be lowered: not tried again
        if nice > 0:
            os.nice(nice)

    def below(self) -> None:
        """Lower the session's autogroup (idempotent)."""
        if self._able and (self._lowered is None or self._lowered.held_s is not None):
            self._lowered = lower(self.nice, self.path)
            self._able = self._lowered is not None

    def level(self) -> None:
        """Give the session's autogroup nice back (idempotent)."""
        if self._lowered is not None:
            self._lowered.restore()

    def said(self) -> dict[str, object]:
        """What the agent reports: its nice, and its session's autogroup nice where it may change it."""
        return {"nice": os.getpriority(os.PRIO_PROCESS, 0),
                "autogroup_nice": current(self.path) if self.own_session else None}
