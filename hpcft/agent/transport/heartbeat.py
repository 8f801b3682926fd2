"""Heartbeats between the agents of one job, for the deaths that close no connection (a frozen node, a partition, a
hung kernel), which would hold a round's all-gather for as long as the peer's sockets stay open. Each agent beats to
its overlay neighbours (mesh.overlay) on connections of their own and names one silent past the loss timeout a suspect
(`on_silent`): the agent fails as if the connection had closed, and the supervisor's probe confirms. One silent past
half that is late (`on_late`): the supervisor probes it ahead, so that its verdict is in when the timeout names it. A
beat connection closed without a goodbye (every orderly close sends one) is a loss at once (`on_closed`): a killed
agent's sockets close with it, and the data mesh would notice only in its next, CPU-capped round."""
from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable, Collection, Mapping

from hpcft.agent.transport.link import COUNT, Either, ProtocolError
from hpcft.agent.transport.mesh import Mesh
from hpcft.agent.transport.rendezvous import Rendezvous
from hpcft.agent.transport.throttle import chore
from hpcft.agent.transport.tcp import TransportError

_log = logging.getLogger(__name__)
LOSS_TIMEOUT_S = 3.0  # the default: a peer silent this long is a suspect (`hpcft run --loss-timeout`)
MAX_PERIOD_S = 0.5
STARVED_S = 0.5  # the beat loop woke this much (or a period, if longer) after it meant to: this agent was paused
BEAT = Either({"beat": COUNT}, {"bye": 1})  # what a neighbour sends on a beat connection


class PeerSilent(TransportError):
    """A peer sent no heartbeat for longer than the loss timeout (`peer_slot` names it)."""


def period_for(timeout: float) -> float:
    """Seconds between beats: a tenth of the loss timeout, half a second at most. A peer is named once silent for the
    timeout plus a period (its last beat may have left a period before it stopped): the shorter, the sooner."""
    return min(MAX_PERIOD_S, timeout / 10)


def silent_peer(heard: Mapping[int, float], now: float, limit: float, skip: Collection[int]) -> int | None:
    """The first peer not in `skip` whose newest beat (`heard`: slot -> when) is more than `limit` seconds old."""
    return next((j for j, when in heard.items() if j not in skip and now - when > limit), None)


def late_peers(heard: Mapping[int, float], now: float, limit: float, skip: Collection[int]) -> list[int]:
    """The peers not in `skip` whose newest beat is more than half `limit` old, in order."""
    return sorted(j for j, when in heard.items() if j not in skip and now - when > limit / 2)


def next_wake(heard: Mapping[int, float], now: float, limit: float, beat_at: float, skip: Collection[int]) -> float:
    """When the beat loop wakes next: at the next beat, or sooner at the first moment a watched peer could be silent
    past `limit` (so a frozen peer is named at its deadline, not at the beat after it)."""
    deadlines = [when + limit for j, when in heard.items() if j not in skip]
    return max(now, min([beat_at, *deadlines]))


class Heartbeat:
    """Beats to the overlay neighbours every `period_for(timeout)` and watches theirs; `suspect` (slot, seconds silent),
    reported once to `on_silent`, once one is silent past `timeout` plus a period (so a shorter pause is never named).
    Silence needs evidence: nothing new for that long, nothing unread in its socket, this agent not itself paused.
    `late`, the peers silent past half that, goes to `on_late` whenever it changes (checked at each beat)."""

    def __init__(self, slot: int, size: int, secret: bytes, rendezvous: Rendezvous | str | os.PathLike, *,
                 timeout: float, on_silent: Callable[[int, float], None],
                 on_closed: Callable[[int], None] | None = None, on_late: Callable[[list[int]], None] | None = None,
                 stopping: Callable[[], bool] = lambda: False,
                 host: str = "127.0.0.1", bind: str = "0.0.0.0", tag: str = "0", join_timeout: float = 60.0):
        self.slot, self.timeout, self.on_silent, self.on_closed = slot, timeout, on_silent, on_closed
        self.on_late = on_late
        self.stopping = stopping  # true once the agents were asked to stop: a close is then no loss
        self.period = period_for(timeout)
        self.mesh = Mesh(slot, size, secret, rendezvous, host=host, bind=bind, timeout=join_timeout,
                         tag=f"{tag}-beat")  # the overlay alone (mesh.overlay)
        now = time.monotonic()
        self.heard = dict.fromkeys(self.mesh.peers, now)  # slot -> when its newest beat arrived
        self.closed: set[int] = set()
        self.suspect: tuple[int, float] | None = None
        self.late: list[int] = []
        self.cause = ""  # what made `suspect` one: "silent" or "closed" (its connection closed without a goodbye)
        self._named = threading.Lock()
        self._sending = threading.Lock()  # the beats and the goodbye share each peer's socket: whole frames only
        self._stop = threading.Event()
        self._threads = [chore(self._listen, j, name=f"hpcft-beat-from-{j}") for j in self.mesh.peers]
        self._threads.append(chore(self._beat, name="hpcft-beat"))
        for t in self._threads:
            t.start()

    def _listen(self, peer: int) -> None:
        ch = self.mesh.channel(peer)
        while not self._stop.is_set():
            try:
                header, _ = ch.recv(shape=BEAT, what="a heartbeat")
            except TransportError as exc:
                if isinstance(exc, ProtocolError):  # a neighbour that breaks the protocol is lost as a closed one
                    _log.warning("%s", exc)
                self.closed.add(peer)
                if not self._stop.is_set() and not self.stopping():  # the peer went without its goodbye
                    self._name(peer, round(time.monotonic() - self.heard[peer], 3), "closed")
                return
            if "bye" in header:
                self.closed.add(peer)  # an orderly close (stopped, done, failed and unwinding): not a loss
                return
            self.heard[peer] = time.monotonic()

    def _name(self, peer: int, seconds: float, cause: str) -> None:
        """Report the first suspect, once, whichever thread found it."""
        with self._named:
            if self.suspect is not None:
                return
            self.suspect, self.cause = (peer, seconds), cause
        if cause == "closed" and self.on_closed is not None:
            self.on_closed(peer)
        elif cause == "silent":
            self.on_silent(peer, seconds)

    def _beat(self) -> None:
        n, limit = 0, self.timeout + self.period
        beat_at = woke = time.monotonic()
        while True:
            skip = self.closed | self._pending_now()
            wake = next_wake(self.heard, woke, limit, beat_at, skip) if self.suspect is None else beat_at
            if self._stop.wait(max(0.0, wake - time.monotonic())):
                return
            now = time.monotonic()
            if now - wake > max(self.period, STARVED_S):  # this agent was paused: what it missed is still to be read
                for j in self.heard:
                    self.heard[j] = max(self.heard[j], now - self.period)
            woke = now
            if now >= beat_at:
                n += 1
                beat_at = now + self.period
                self._send_beats(n)
            if self.suspect is None:
                self._check(time.monotonic(), limit)

    def _send_beats(self, n: int) -> None:
        with self._sending:
            if not self._stop.is_set():
                self._send_all({"beat": n})

    def _send_all(self, message: dict) -> None:
        """`message` to every neighbour not closed (under `_sending`); one that cannot take it counts as closed."""
        for j in list(self.mesh.peers):
            if j not in self.closed:
                try:
                    self.mesh.channel(j).send(message)
                except TransportError:
                    self.closed.add(j)

    def _check(self, now: float, limit: float) -> None:
        skip = self.closed | self._pending_now()
        j = silent_peer(self.heard, now, limit, skip)
        if j is not None:
            self._name(j, round(now - self.heard[j], 3), "silent")
            return
        late = late_peers(self.heard, now, limit, skip)
        if late != self.late:
            self.late = late
            if self.on_late is not None:
                self.on_late(late)

    def _pending_now(self) -> set[int]:
        """The peers silent past half the limit whose bytes wait unread (their listener is behind): not silence."""
        half = time.monotonic() - (self.timeout + self.period) / 2
        return {j for j, when in self.heard.items() if when < half and j not in self.closed and self._pending(j)}

    def _pending(self, peer: int) -> bool:
        """Bytes from `peer` wait unread (its listener thread is behind): not silence."""
        try:
            ready, _, _ = select.select([self.mesh.channel(peer).sock], [], [], 0)
        except (OSError, ValueError):
            return False
        return bool(ready)

    def close(self) -> None:
        self._stop.set()
        with self._sending:
            self._send_all({"bye": 1})  # the goodbye: this close is no loss to the peers that hear it
        self.mesh.abort()  # ends the listeners' blocking reads
        self.mesh.close()
        for t in self._threads:
            t.join(2.0)
