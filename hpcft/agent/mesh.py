"""The agents of one job connected all-to-all over the authenticated transport. Addresses meet in a
rendezvous directory shared by the nodes (the job's directory on the shared file system); slot i
connects to every lower slot and accepts every higher one, so the mesh forms without deadlock. A mesh may also
join only some of the slots (`peers`, the same relation on every agent: the heartbeats' overlay)."""
from __future__ import annotations

import os
import socket
import time
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from hpcft.agent.throttle import Throttle
from hpcft.agent.transport import Channel, Listener, TransportError, connect


class Mesh:
    """Channels to every other agent (or to `peers` only, a symmetric relation), keyed by slot; `allgather` for small
    JSON values (all-to-all meshes only)."""

    def __init__(self, slot: int, size: int, secret: bytes, rendezvous: str | os.PathLike, *, host: str = "127.0.0.1",
                 bind: str = "0.0.0.0", timeout: float = 60.0, rate: float | None = None, cpu: float | None = None,
                 tag: str = "0", peers: Collection[int] | None = None):
        self.slot, self.size = slot, size
        self.throttle = Throttle(rate, cpu=cpu)
        self.listener = Listener(secret, host=bind, throttle=self.throttle)
        self.peers: dict[int, Channel] = {}
        base = Path(rendezvous)
        _publish(base / f"agent-{tag}-{slot}.addr", f"{host}:{self.listener.port}")
        deadline = time.monotonic() + timeout
        wanted = set(range(size)) - {slot} if peers is None else set(peers) - {slot}
        try:
            for j in sorted(j for j in wanted if j < slot):
                peer_host, port = _wait_for(base / f"agent-{tag}-{j}.addr", deadline).rsplit(":", 1)
                ch = connect(secret, peer_host, int(port), timeout=max(1.0, deadline - time.monotonic()),
                             throttle=self.throttle)
                ch.send({"hello": slot})
                self.peers[j] = ch
            for _ in range(sum(1 for j in wanted if j > slot)):
                ch = self.listener.accept(max(1.0, deadline - time.monotonic()))
                header, _ = ch.recv()
                j = int(header["hello"])
                if j not in wanted or j in self.peers:
                    ch.close()
                    raise TransportError(f"agent {j} joined mesh {tag} of slot {slot}, which expects {sorted(wanted)}")
                self.peers[j] = ch
        except Exception:
            self.close()
            raise

    def pace(self) -> None:
        """Wait as long as the CPU cap requires before more local work (allocating, encoding): the CPU the agent
        spent since the last payment, on any thread, is paid here."""
        self.throttle.take(0)

    def send(self, peer: int, header: dict[str, Any], parts: Sequence[Any] = ()) -> None:
        with _blaming(peer):
            self.peers[peer].send_parts(header, parts)

    def recv(self, peer: int, into: np.ndarray | None = None) -> tuple[dict[str, Any], np.ndarray]:
        with _blaming(peer):
            return self.peers[peer].recv(into)

    def channel(self, peer: int) -> Channel:
        return self.peers[peer]

    def allgather(self, value: Any) -> list[Any]:
        """Every agent's `value` (JSON-able, small), indexed by slot."""
        for j, ch in self.peers.items():
            with _blaming(j):
                ch.send({"allgather": value})
        out: list[Any] = [None] * self.size
        out[self.slot] = value
        for j, ch in self.peers.items():
            with _blaming(j):
                header, _ = ch.recv()
            if "allgather" not in header:
                raise TransportError(f"agent {j} sent {sorted(header)} during an all-gather")
            out[j] = header["allgather"]
        return out

    @contextmanager
    def all_or_nothing(self) -> Iterator[None]:
        """Around a multi-threaded exchange: if any part fails, shut every connection down, so no thread here
        or on a peer stays blocked on a message that will never come; every agent then fails and relaunches."""
        try:
            yield
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Shut down every connection (unblocks receivers in other threads; peers see the end of stream)."""
        for ch in self.peers.values():
            try:
                ch.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        for ch in self.peers.values():
            ch.close()
        self.listener.close()


@contextmanager
def _blaming(peer: int) -> Iterator[None]:
    """A TransportError of an exchange with the agent of slot `peer` names that slot (unless it names one already).
    The all-gather that opens every round is the agents' heartbeat: a peer that died fails it on every survivor."""
    try:
        yield
    except TransportError as exc:
        if exc.peer_slot is None:
            exc.peer_slot = peer
        raise


def _publish(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.dirty")
    tmp.write_text(text)
    os.replace(tmp, path)


def _wait_for(path: Path, deadline: float) -> str:
    while True:
        try:
            return path.read_text()
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise TransportError(f"agent address {path} did not appear in time; is that agent running?") from None
            time.sleep(0.05)
