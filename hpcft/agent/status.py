"""Each agent's status: its phase (rebuilding → ready → protecting, or failed), the newest step staged, protected and
persisted, and a heartbeat time. Under `hpcft run` it goes to the supervisor, which writes the job's bounded log
`<job dir>/status.json`; agents started by hand write status files in the rendezvous directory. `read` serves both."""
from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcft.errors import CheckpointError, NoCheckpointError
from hpcft.store.paths import replace_file

REBUILDING, READY, PROTECTING, FAILED = "rebuilding", "ready", "protecting", "failed"
STOPPED = "stopped"  # asked to stop (SIGTERM): the node's data was intact when the agent left
TERMINAL = (STOPPED, FAILED)  # an agent's last phases: it runs no more
_NAME = re.compile(r"agent-(.+)-(\d+)\.status$")
LOG = "status.json"  # the supervisor's bounded log, in the job directory (the rendezvous directory's parent)


def path(rendezvous: str | os.PathLike, tag: str, slot: int) -> Path:
    return Path(rendezvous) / f"agent-{tag}-{slot}.status"


def write(rendezvous: str | os.PathLike, tag: str, slot: int, **fields: Any) -> None:
    """Publish this agent's status atomically (write, then rename); `time` is the heartbeat."""
    data = json.dumps({"slot": slot, "tag": tag, "pid": os.getpid(), "time": time.time(), **fields}, sort_keys=True)
    replace_file(path(rendezvous, tag, slot), data.encode())


def drain_path(rendezvous: str | os.PathLike, tag: str) -> Path:
    """The supervisor's request to the agents of launch `tag` to protect now without the caps: the trainers have
    stopped (named so that a relaunch's cleanup of `agent-<tag>-*` removes it)."""
    return Path(rendezvous) / f"agent-{tag}-drain"


def request_drain(rendezvous: str | os.PathLike, tag: str) -> None:
    drain_path(rendezvous, tag).touch()


def stop_path(rendezvous: str | os.PathLike, tag: str) -> Path:
    """The supervisor's request to the agents of launch `tag` to stop, each exiting 0 with status `stopped` (srun
    answers a SIGTERM by killing the step's tasks)."""
    return Path(rendezvous) / f"agent-{tag}-stop"


def request_stop(rendezvous: str | os.PathLike, tag: str) -> None:
    stop_path(rendezvous, tag).touch()


class Requests:
    """What the supervisor asks the agents of launch `tag`: a drain, a stop, a flush (its id). Under `hpcft run` the
    supervisor pushes them on the node's uplink (`orders`, read in memory: nothing per node polls the shared file
    system); agents started by hand read the request files the supervisor also writes."""

    def __init__(self, rendezvous: str | os.PathLike, tag: str, orders: Callable[[], dict[str, Any]] | None = None):
        self.rendezvous, self.tag, self._orders = rendezvous, tag, orders

    def _asked(self) -> dict[str, Any]:
        """This launch's requests as pushed (only with an uplink: `_orders` set)."""
        return (self._orders() or {}).get(self.tag, {})

    def drain(self) -> bool:
        if self._orders is not None:
            return bool(self._asked().get("drain"))
        return drain_path(self.rendezvous, self.tag).exists()

    def stop(self) -> bool:
        if self._orders is not None:
            return bool(self._asked().get("stop"))
        return stop_path(self.rendezvous, self.tag).exists()

    def flush(self) -> str | None:
        """The id of the newest flush asked for, or None."""
        if self._orders is not None:
            asked = self._asked().get("flush")
            return str(asked) if asked else None
        from hpcft.agent.protection.flush import read_request  # the file's format is the flush's

        return read_request(self.rendezvous, self.tag)


def read_log(where: str | os.PathLike) -> dict[str, Any]:
    """The supervisor's bounded log in directory `where` (or its parent, for a rendezvous directory); {} if none."""
    for candidate in (Path(where) / LOG, Path(where).parent / LOG):
        try:
            return json.loads(candidate.read_text(encoding="utf-8"))
        except FileNotFoundError:
            continue
        except (OSError, ValueError):
            return {}  # replaced atomically: unreadable means being written for the first time, or not ours
    return {}


def from_log(log: dict[str, Any], tag: str | None = None) -> dict[int, dict[str, Any]]:
    """{slot: status} of launch `tag` (the newest per slot when None) in a bounded log's content."""
    return _newest((int(s), st) for t, slots in (log.get("agents") or {}).items() if tag in (None, t)
                   for s, st in slots.items())


def read(rendezvous: str | os.PathLike, tag: str | None = None) -> dict[int, dict[str, Any]]:
    """{slot: status} of the agents of launch `tag`, or of the newest launch per slot when `tag` is None: from their
    status files, else from the supervisor's bounded log (up to a second old)."""
    files = list(Path(rendezvous).glob("agent-*.status"))
    if not files:
        return from_log(read_log(rendezvous), tag)
    found = []
    for p in files:
        m = _NAME.match(p.name)
        if m and tag in (None, m.group(1)):
            with suppress(OSError, ValueError):  # replaced under us; the next read sees the new one
                found.append((int(m.group(2)), json.loads(p.read_text(encoding="utf-8"))))
    return _newest(found)


def _newest(statuses: Iterable[tuple[int, dict[str, Any]]]) -> dict[int, dict[str, Any]]:
    """{slot: its newest status (by `time`)} of (slot, status) pairs."""
    found: dict[int, dict[str, Any]] = {}
    for slot, st in statuses:
        if slot not in found or st.get("time", 0) > found[slot].get("time", 0):
            found[slot] = st
    return found


@dataclass(frozen=True)
class Ready:
    """Every agent of a launch finished its rebuild: the step all slots hold (None on a fresh run)."""
    step: int | None
    rebuilt: tuple[int, ...]


def wait_ready(rendezvous: str | os.PathLike, tag: str, slots: int, timeout: float = 600.0,
               poll: float = 0.1, reports: Callable[[str], dict[int, dict[str, Any]]] | None = None) -> Ready:
    """Block until the `slots` agents of launch `tag` have rebuilt (the gate before the trainers start), reading
    `reports(tag)` or else `read`. NoCheckpointError if nothing was rebuildable; CheckpointError otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        st = reports(tag) if reports is not None else read(rendezvous, tag)
        failed = {s: v for s, v in st.items() if v.get("phase") == FAILED}
        if failed:
            slot, v = sorted(failed.items())[0]
            cls = NoCheckpointError if v.get("reason") == "no_checkpoint" else CheckpointError
            raise cls(f"agent of slot {slot} failed: {v.get('error')}")
        done = [v for v in st.values() if v.get("phase") in (READY, PROTECTING)]
        if len(done) == slots:
            return Ready(done[0].get("rebuilt_step"), tuple(done[0].get("rebuilt") or ()))
        if time.monotonic() > deadline:
            missing = sorted(set(range(slots)) - {int(v["slot"]) for v in done})
            raise CheckpointError(f"agents of slots {missing} did not finish their rebuild within {timeout:g} s; "
                                  f"see their logs and {rendezvous}")
        time.sleep(poll)
