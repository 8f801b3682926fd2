"""The agents of one job over the authenticated transport: channels only to the slots each exchanges bulk data with and
to its overlay neighbours, over which `allgather` and `allreduce` agree in ⌈log2 N⌉ rounds. Slot i connects to the
lower slots it wants and accepts the higher ones, so the mesh forms without deadlock."""
from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from hpcft import events
from hpcft.agent.transport.rendezvous import Rendezvous, join
from hpcft.agent.transport.throttle import Throttle
from hpcft.agent.transport.link import Link, PeerGaveUp, ProtocolError, TransportError, mismatch, notice
from hpcft.agent.transport.tcp import Channel, Listener, connect

_log = logging.getLogger(__name__)


def overlay(slot: int, size: int) -> list[int]:
    """The slots ±2^k from `slot` around the ring (a symmetric relation): the all-gather's partners and the heartbeats'
    watchers, about 2·log2(N) each, every other slot up to 5."""
    out: set[int] = set()
    step = 1
    while step < size:
        out.update({(slot + step) % size, (slot - step) % size})
        step *= 2
    out.discard(slot)
    return sorted(out)


class MeshBase:
    """The agents' exchanges and agreements over `peers` (slot → Link), for every carrier: a subclass (Mesh: TCP,
    mpimesh.MpiMesh: MPI) connects them and sets `slot`, `size`, `throttle`, `address` and `peers`."""

    slot: int
    size: int
    throttle: Throttle
    address: str
    peers: dict[int, Link]

    def pace(self) -> None:
        """Wait as long as the CPU cap requires before more local work (allocating, encoding): the CPU the agent
        spent since the last payment, on any thread, is paid here."""
        self.throttle.take(0)

    def send(self, peer: int, header: dict[str, Any], parts: Sequence[Any] = ()) -> None:
        with _blaming(peer):
            self._channel(peer).send_parts(header, parts)

    def recv(self, peer: int, into: np.ndarray | None = None, shape: Any = object,
             what: str = "a message") -> tuple[dict[str, Any], np.ndarray]:
        """The next message from `peer`, its header checked against `shape` (link.mismatch), its errors naming it."""
        with _blaming(peer):
            return self._channel(peer).recv(into, shape, what)

    def channel(self, peer: int) -> Link:
        return self._channel(peer)

    def _channel(self, peer: int) -> Link:
        try:
            return self.peers[peer]
        except KeyError:
            raise TransportError(f"slot {self.slot} has no connection to slot {peer}: it exchanges data only with "
                                 f"{sorted(self.peers)} (placement.exchange_peers and the overlay)") from None

    def allgather(self, value: Any, shape: Any = object) -> list[Any]:
        """Every agent's `value` (JSON-able, small), indexed by slot; each agent receives all N values (`allreduce`
        where a combination suffices). Each value must fit `shape`, each round carry exactly its sender's window."""
        known = {self.slot: value}

        def send(step: int) -> list[list[Any]]:
            return [[j, known[j]] for j in self._window(self.slot, step)]

        def expect(step: int) -> tuple:
            return tuple((j, shape) for j in self._window((self.slot - step) % self.size, step))

        def merge(_step: int, got: list[list[Any]]) -> None:
            known.update(got)

        self._rounds("allgather", send, merge, expect)
        return [known[j] for j in range(self.size)]

    def _window(self, sender: int, step: int) -> list[int]:
        """The slots whose values `sender` passes on in round `step` of an all-gather: its own and the newest before."""
        return [(sender - k) % self.size for k in range(min(step, self.size - step))]

    def allreduce(self, value: Any, combine: Callable[[Any, Any], Any], shape: Any = object) -> Any:
        """Every agent's `value` combined, in ⌈log2 N⌉ messages of one value's size; `combine` must be associative,
        commutative and idempotent (windows overlap). A result unfit for `shape` or `combine` is the sender's error."""
        acc = [value]

        def merge(_step: int, got: Any) -> None:
            acc[0] = combine(acc[0], got)

        self._rounds("allreduce", lambda _step: acc[0], merge, lambda _step: shape)
        return acc[0]

    def exchange(self, peers: Collection[int], value: Any, shape: Any = object) -> dict[int, Any]:
        """{slot: value} of this agent and its `peers` (a symmetric relation), each sending its small `value` to the
        others; each fitting `shape`. A failure is handled as an agreement's."""
        got = {self.slot: value}
        try:
            for j in sorted(peers):
                self.send(j, {"exchange": value})
            for j in sorted(peers):
                header, _ = self.recv(j, shape={"exchange": shape}, what="a message in an exchange of values")
                got[j] = header["exchange"]
        except TransportError as exc:
            self.give_up(exc)
            raise
        return got

    def _rounds(self, kind: str, send: Callable[[int], Any], merge: Callable[[int, Any], None],
                expect: Callable[[int], Any]) -> None:
        """An agreement's rounds: `send(2^k)` to slot + 2^k, `merge(2^k, what slot − 2^k sent)` fitting `expect(2^k)`;
        a failing agent tells its connections whom it lost, so all fail within log2 N hops naming the same slot."""
        step = 1
        try:
            while step < self.size:
                dst, src = (self.slot + step) % self.size, (self.slot - step) % self.size
                self.send(dst, {kind: send(step), "round": step})
                header, _ = self.recv(src, shape={kind: expect(step), "round": step},
                                      what=f"a message in round {step} of an {kind}")
                try:
                    merge(step, header[kind])
                except (TypeError, ValueError, KeyError, AttributeError) as exc:  # what a caller's `shape` let through
                    err = ProtocolError(f"the agent of slot {src} sent, in round {step} of an {kind}, a value this "
                                        f"agent cannot take ({type(exc).__name__}: {exc}); protocol error")
                    err.peer_slot = src
                    raise err from exc
                step *= 2
        except TransportError as exc:
            self.give_up(exc)
            raise

    def give_up(self, exc: TransportError) -> None:
        """Tell every connection this agent stops (naming the slot it lost: `exc.peer_slot`), then shut them down."""
        lost = exc.peer_slot if exc.peer_slot is not None else self.slot
        message = notice(self.slot, lost, str(exc))
        for j, ch in self.peers.items():
            if j != exc.peer_slot:
                ch.tell(message)
        if not isinstance(exc, PeerGaveUp):
            events.emit("mesh_gave_up", level=logging.WARNING, slot=self.slot, lost=lost, error=str(exc),
                        told=len(self.peers) - (exc.peer_slot in self.peers))
        self.abort()

    @contextmanager
    def all_or_nothing(self) -> Iterator[None]:
        """Around a multi-threaded exchange: any failure shuts every connection down, so no thread here or on a peer
        waits for a message that will never come."""
        try:
            yield
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Shut down every connection (unblocks receivers in other threads; peers see the end of stream)."""
        for ch in self.peers.values():
            ch.shutdown()

    def close(self) -> None:
        for ch in self.peers.values():
            ch.close()


class Mesh(MeshBase):
    """Channels to `peers` and the overlay neighbours, keyed by slot, over authenticated TCP. `rendezvous`: a
    Rendezvous, or the rendezvous directory (rendezvous.join)."""

    def __init__(self, slot: int, size: int, secret: bytes, rendezvous: Rendezvous | str | os.PathLike, *,
                 host: str = "127.0.0.1", bind: str = "0.0.0.0", timeout: float = 60.0, rate: float | None = None,
                 cpu: float | None = None, tag: str = "0", peers: Collection[int] = ()):
        self.slot, self.size = slot, size
        self.throttle = Throttle(rate, cpu=cpu)
        self.listener = Listener(secret, host=bind, throttle=self.throttle)
        self.peers: dict[int, Channel] = {}
        self.address = f"{host}:{self.listener.port}"
        self._own = None if isinstance(rendezvous, Rendezvous) else \
            join(secret, rendezvous, slot=slot, tag=tag, host=host, bind=bind, timeout=timeout)
        meet = rendezvous if self._own is None else self._own
        deadline = time.monotonic() + timeout
        wanted = (set(peers) | set(overlay(slot, size))) - {slot}
        bad = sorted(j for j in wanted if not 0 <= j < size)
        try:
            if bad:
                raise TransportError(f"slot {slot} was asked to connect to slots {bad}, outside 0..{size - 1}")
            with self.throttle.uncapped():  # meeting the peers is no protection work: the trainers wait for it
                self._connect(secret, meet, tag, wanted, deadline, timeout)
        except Exception:
            self.close()
            raise

    def _connect(self, secret: bytes, meet: Rendezvous, tag: str, wanted: set[int], deadline: float,
                 timeout: float) -> None:
        """Connect to the lower slots (a hello: who and where registered) and accept the higher ones (`_admit`). A
        connection counts once welcomed; a refused one fails here, told why, not in a later round."""
        slot = self.slot
        lower = sorted(j for j in wanted if j < slot)
        where = meet.meet(tag, slot, self.address, sorted(wanted), timeout)  # once all of them have registered
        for j in lower:
            with _blaming(j):
                ch = connect(secret, *_host_port(where[j]), timeout=_left(deadline), throttle=self.throttle)
                self.peers[j] = ch  # closed with the mesh from here on
                ch.slot = j
                ch.send({"hello": slot, "tag": tag, "to": j, "addr": self.address})
        for _ in range(len(wanted) - len(lower)):
            self._admit(self.listener.accept(_left(deadline)), tag, wanted, where, deadline)
        for j in lower:  # read after accepting, so that no agent's start waits on a chain of lower ones
            with _blaming(j):  # a refusal arrives as the refuser's give-up notice (PeerGaveUp)
                _recv_by(self.peers[j], deadline, {"welcome": j}, "its answer to this agent's hello")

    def _admit(self, ch: Channel, tag: str, wanted: set[int], where: dict[int, str], deadline: float) -> None:
        """Key `ch` by the slot its hello claims and welcome it; or refuse it, told why, and raise: a hello malformed,
        for another launch or slot, from a slot not expected or already here, or not from its registered address."""
        claimed = {"hello": range(self.slot + 1, self.size), "tag": tag, "to": self.slot, "addr": str}
        try:
            header = _recv_by(ch, deadline, object, "a hello")
            if mismatch(header.get("hello"), claimed["hello"]) is None:
                ch.slot = header["hello"]  # whoever it is, the slot it claims: its errors name that slot
            ch.check(header, claimed, "a hello")
            j = header["hello"]
            if j not in wanted or j in self.peers:
                raise ProtocolError(f"the agent of slot {j} ({ch.peer}) joined mesh {tag} of slot {self.slot}, which "
                                    f"expects {sorted(wanted)} and has {sorted(self.peers)} already")
            if header["addr"] != where[j]:
                raise ProtocolError(f"{ch.peer} claims slot {j} from {header['addr']!r}, but slot {j} registered "
                                    f"{where[j]!r} at the agents' directory")
        except TransportError as exc:
            if exc.peer_slot is None:
                exc.peer_slot = ch.slot
            ch.tell(notice(self.slot, self.slot, f"slot {self.slot} refused this connection: {exc}"))
            ch.close()
            raise
        self.peers[j] = ch
        with _blaming(j):
            ch.send({"welcome": self.slot})

    def close(self) -> None:
        super().close()
        self.listener.close()
        if self._own is not None:
            self._own.close()


def _left(deadline: float) -> float:
    return max(1.0, deadline - time.monotonic())


def _host_port(address: str) -> tuple[str, int]:
    """`host:port` as the directory gave it, checked (a ProtocolError naming the address otherwise)."""
    host, _, port = address.rpartition(":")
    if not host or not re.fullmatch(r"[0-9]{1,5}", port) or not 0 < int(port) < 65536:
        raise ProtocolError(f"the address {address!r} registered at the agents' directory is not host:port")
    return host, int(port)


def _recv_by(ch: Channel, deadline: float, shape: Any, what: str) -> dict[str, Any]:
    """`ch`'s next header, fitting `shape`, by `deadline`: a silent peer holds no agent up while the mesh forms."""
    ch.sock.settimeout(_left(deadline))
    try:
        return ch.recv(shape=shape, what=what)[0]
    finally:
        ch.sock.settimeout(None)


@contextmanager
def _blaming(peer: int) -> Iterator[None]:
    """A TransportError of an exchange with slot `peer` names that slot, unless it names one already."""
    try:
        yield
    except TransportError as exc:
        if exc.peer_slot is None:
            exc.peer_slot = peer
        raise
