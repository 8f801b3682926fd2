"""A session's CPU priority against the other sessions of its machine, lowered for a while and given back. Linux
schedules each session as one group (autogroup, sched(7)), so a plain nice yields only to the session's own
processes, and an unprivileged process cannot undo a nice; the autogroup's nice (/proc/self/autogroup) does both.
For a spare node's warm standby, whose import must not slow the active nodes' where nodes share cores (the
sandbox); on a node of its own nothing competes and the nice costs nothing."""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def lowered(nice: int = 19, path: Path = PATH) -> Iterator[bool]:
    """Run the block at autogroup nice `nice`, then restore the nice it had; yields whether it was lowered (False,
    nothing changed, where the kernel has no autogroups or refuses)."""
    before = current(path)
    if before is None or before >= nice or not _set(path, nice):
        yield False
        return
    try:
        yield True
    finally:
        if not _set(path, before):
            _log.warning("could not restore the autogroup nice %d (it stays %d)", before, nice)
