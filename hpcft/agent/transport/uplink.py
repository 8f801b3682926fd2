"""A node's reports to the supervisor's report service ($HPCFT_REPORTS) on one authenticated connection, instead of
files on the shared file system: its agent's status, its ranks' progress (read from the node-local store) and the
agent's events. Only what changed is sent, at most once per `gap` seconds (what the supervisor waits on: a new
phase, protected step, drain or flush state, late peers; a warning and the last report at once), so N nodes send
about N small messages a second. Unreachable, a node retries every `gap` and writes its events to the job's events
file meanwhile; agents started by hand (no $HPCFT_REPORTS) write status files instead."""
from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hpcft import events
from hpcft.env import REPORTS
from hpcft.store import progress as store_progress

from hpcft.agent.transport.rendezvous import Rendezvous
from hpcft.agent.transport.throttle import chore
from hpcft.agent.transport.tcp import Channel, TransportError

ENV = REPORTS  # exported by hpcft run
GAP_S = 1.0  # the most one node reports per second, but for what the supervisor waits on (URGENT), warnings, the last
URGENT = ("phase", "protected", "drained", "flushing", "flushed_request", "late_peers")  # a change leaves at once
PROGRESS_S = 0.25  # how often the node's ranks' progress is looked at in its store (a stat per manifest)
CLOSE_S = 3.0  # the most `close` waits for the last report to leave
KEEPALIVE_S = 5.0  # with nothing new for this long, an empty report: the supervisor tells silence from no progress
_log = logging.getLogger(__name__)


def delta(old: Mapping[str, Any], new: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """What turns `old` into `new`: (the keys set anew or changed, the keys dropped)."""
    return {k: v for k, v in new.items() if k not in old or old[k] != v}, sorted(k for k in old if k not in new)


def patch(old: Mapping[str, Any], changed: Mapping[str, Any], dropped: list[str]) -> dict[str, Any]:
    """`old` with a `delta` applied."""
    out = {k: v for k, v in old.items() if k not in dropped}
    out.update(changed)
    return out


class Uplink:
    """One node's connection to the supervisor: `status(**fields)` replaces the agent's report, `event(record)` queues
    an event, `progress()` (called every PROGRESS_S) gives {rank: (step, ready_s)}."""

    def __init__(self, address: str, secret: bytes, *, tag: str, slot: int, node: str,
                 progress: Callable[[], Mapping[int, tuple[int, float | None]]] | None = None, gap: float = GAP_S,
                 every: float = PROGRESS_S):
        self.address, self.secret, self.tag, self.slot, self.node = address, secret, tag, slot, node
        self.progress, self.gap, self.every = progress, gap, every
        self._cv = threading.Condition()
        self._status: dict[str, Any] | None = None
        self._ranks: dict[str, list] = {}
        self._events: list[dict] = []
        self._urgent = self._closing = False
        self._ch: Channel | None = None
        self._sent_status: dict[str, Any] | None = None  # what the supervisor holds (None: send it whole)
        self._sent_ranks: dict[str, list] = {}
        self._failures = 0
        self.sent = 0  # messages sent (for tests and the scale figures)
        self.orders: dict[str, dict[str, Any]] = {}  # {tag: what the supervisor asks}, as it pushed them last
        self._thread = chore(self._run, name="hpcft-uplink")
        self._thread.start()

    @property
    def connected(self) -> bool:
        return self._ch is not None

    def status(self, **fields: Any) -> None:
        """The agent's new report (the fields of agent/status.py `write`). What the supervisor waits on leaves at once:
        a new phase; a newly protected step (every member of a set commits it together, and the supervisor's view of
        the set must not pair one member's report from before the commit with another's from after it: no step in
        common); a drain taken (a persist waits for it), a flush's start and end, a late peer (probed ahead)."""
        report = {"slot": self.slot, "tag": self.tag, "pid": os.getpid(), "time": time.time(), **fields}
        with self._cv:
            last = self._status or {}
            self._urgent |= any(last.get(k) != report.get(k) for k in URGENT)
            self._status = report
            self._cv.notify()

    def amend(self, **fields: Any) -> None:
        """Change `fields` of the agent's last report and send it at once (from a thread beside the round loop)."""
        with self._cv:
            if self._status is None:
                return
            self._status = {**self._status, **fields}
            self._urgent = True
            self._cv.notify()

    def event(self, record: dict) -> bool:
        """Queue an event for the supervisor's events file; False when not connected (the caller writes it)."""
        with self._cv:
            if self._ch is None or self._closing:
                return False
            self._events.append(record)
            self._urgent |= record.get("level") not in ("INFO", "DEBUG")
            self._cv.notify()
        return True

    def close(self, timeout: float = CLOSE_S) -> None:
        """Send what is pending (the last report) and close; events not sent by then go to the events file."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join(timeout)
        with self._cv:
            left, self._events = self._events, []
        for record in left:
            events.write(record)
        if self._ch is not None:
            self._ch.close()

    def _run(self) -> None:
        next_read = next_send = last_sent = 0.0
        try:
            self._ch = self._connect()
        except TransportError as exc:  # retried at the first report
            _log.warning("cannot reach the supervisor's report service yet: %s", exc)
        while True:
            now = time.monotonic()
            if self.progress is not None and (now >= next_read or self._closing):  # the last report: fresh
                try:
                    ranks = {str(r): [s, t] for r, (s, t) in self.progress().items()}
                except OSError as exc:  # a store being cleaned up: progress is best effort
                    _log.debug("cannot read progress: %s", exc)
                    ranks = self._ranks
                with self._cv:
                    self._ranks = ranks
                next_read = now + self.every
            with self._cv:
                closing = self._closing
                due = closing or self._urgent or now >= next_send
                message = self._message(keepalive=now - last_sent >= KEEPALIVE_S) if due else None
                self._urgent = False
            if message is not None:
                self._send(message)
                next_send = last_sent = time.monotonic()
                next_send += self.gap
            if closing:
                return
            with self._cv:
                if not self._closing and not self._urgent:
                    wake = last_sent + KEEPALIVE_S
                    if self.progress is not None:
                        wake = min(wake, next_read)
                    if self._pending():  # something new, held back by the gap
                        wake = min(wake, next_send)
                    self._cv.wait(max(0.01, wake - time.monotonic()))

    def _pending(self) -> bool:
        """Whether something is not sent yet (under the lock)."""
        return self._status is not self._sent_status or bool(self._events) or self._ranks != self._sent_ranks

    def _message(self, keepalive: bool = False) -> dict[str, Any] | None:
        """What changed since the last message (under the lock), or None (with `keepalive`: an empty report)."""
        msg: dict[str, Any] = {"tag": self.tag, "slot": self.slot, "node": self.node}
        if self._status is not None:
            if self._sent_status is None:
                msg.update(full=True, set=self._status)
            else:
                changed, dropped = delta(self._sent_status, self._status)
                if changed or dropped:
                    msg.update(set=changed, drop=dropped)
        ranks, _ = delta(self._sent_ranks, self._ranks)
        if ranks:
            msg["progress"] = ranks
        if self._events:
            msg["events"], self._events = self._events, []
        if len(msg) == 3 and not keepalive:
            return None
        self._sent_status, self._sent_ranks = self._status, dict(self._ranks)
        return msg

    def _send(self, message: dict[str, Any]) -> None:
        try:
            if self._ch is None:
                self._ch = self._connect()
            self._ch.send({"report": message})
            self.sent += 1
            self._failures = 0
        except TransportError as exc:
            self._failures += 1
            if self._failures == 1:
                _log.warning("cannot report to the supervisor at %s (retrying every %g s): %s", self.address,
                             self.gap, exc)
            with self._cv:  # the next connection starts over: the whole status, every rank
                if self._ch is not None:
                    self._ch.close()
                self._ch, self._sent_status, self._sent_ranks = None, None, {}
            for record in message.get("events", []):  # no event is lost: to the events file, as while unconnected
                events.write(record)

    def _connect(self) -> Channel:
        """A channel to the report service (its addresses tried in turn, as the directory's: agent/rendezvous.py), and
        a thread reading what the supervisor pushes on it (its orders) until it closes."""
        ch = Rendezvous(self.address, self.secret, how=ENV)._connect(5.0)
        chore(self._listen, ch, name="hpcft-uplink-orders").start()
        return ch

    def _listen(self, ch: Channel) -> None:
        while True:
            try:
                header, _ = ch.recv_header()
            except TransportError:
                return  # closed: the next connection has a listener of its own
            if isinstance(header.get("orders"), dict):
                self.orders = header["orders"]


def from_env(secret: bytes, *, tag: str, slot: int, node: str, job: Path | None,
             environ: Mapping[str, str] = os.environ) -> Uplink | None:
    """The uplink of a node under `hpcft run` (None without $HPCFT_REPORTS): the progress of the slot's ranks in store
    `job` (None: none, e.g. a hosted agent) and this process's events; closed at exit, so the last report leaves."""
    address = environ.get(ENV)
    if not address:
        return None
    tasks = int(environ.get("HPCFT_LAYOUT_TASKS") or 0)
    ranks = range(slot * tasks, (slot + 1) * tasks) if tasks else None
    up = Uplink(address, secret, tag=tag, slot=slot, node=node,
                progress=None if job is None else lambda: store_progress.node(job, ranks))
    events.forward(up.event)

    def done() -> None:
        events.forward(None)
        up.close()

    atexit.register(done)
    return up
