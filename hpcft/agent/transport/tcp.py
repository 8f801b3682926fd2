"""Authenticated TCP between the agents of one job: a mutual HMAC-SHA256 challenge–response over the per-job secret
opens each connection (a peer that fails it is refused, told so and logged), each incoming handshake under one overall
deadline off the accept path, so a client that trickles bytes or none delays no other peer. Nothing is unpickled."""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import queue
import selectors
import socket
import struct
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import Any

import numpy as np

from hpcft import events
from hpcft.agent.transport.link import Link, TransportError, received
from hpcft.agent.transport.throttle import Throttle, chore

_log = logging.getLogger(__name__)
MAGIC = b"HPCFT-AGENT/2\n"  # /2: the server sends its verdict (ACCEPTED / REFUSED) before its proof
NONCE = 32
MAC = hashlib.sha256().digest_size
_FRAME = struct.Struct("!IQ")  # header length, payload length
MAX_HEADER = 1 << 20
SEND_PIECE = 4 << 20
HANDSHAKE_S = 10.0  # one deadline for a whole handshake, not per byte
MAX_PENDING = 1024  # handshakes in progress at once; when more arrive, the oldest is dropped
ACCEPTED, REFUSED = b"+", b"-"  # the server's verdict, before its proof: a refused client is told so
NOTICE_S = 1.0  # the most a give-up notice may wait to be sent (a frozen neighbour's full buffer)
SOCKET_BUFFER = 4 << 20  # send/receive buffers: fewer wake-ups and copies per byte than the defaults (measured)


class AuthError(TransportError):
    """The other side did not prove it holds this job's secret."""


def _mac(secret: bytes, role: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, role + b"".join(parts), hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf), deadline)
    return bytes(buf)


def _recv_into(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill `view`; with `deadline` (time.monotonic()), all of it by then (socket.timeout), however bytes trickle in."""
    got = 0
    while got < len(view):
        if deadline is not None:
            sock.settimeout(max(1e-3, deadline - time.monotonic()))
        n = sock.recv_into(view[got:])
        if n == 0:
            raise TransportError(f"peer closed the connection after {got} of {len(view)} bytes")
        got += n


class Channel(Link):
    """One authenticated connection: `send(header, payload)` and `recv(into=)`, in order, both ways."""

    def __init__(self, sock: socket.socket, peer: str, throttle: Throttle | None = None):
        self.sock = sock
        self.peer = peer
        self.throttle = throttle or Throttle(None)
        self.sent = 0  # bytes sent on this channel, framing included (what the agents' traffic figures count)
        sock.settimeout(None)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
        # small messages (all-gathers, heartbeats) leave at once: Nagle's wait for the ACK of the previous one, which
        # the peer delays up to 40 ms, cost a 5-55 ms agreement at 8-16 agents (hpcft bench scale)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send_parts(self, header: dict[str, Any], parts: Sequence[Any]) -> None:
        """Send `header` and the concatenation of `parts` as one payload (in pieces, throttled, no copy)."""
        head = json.dumps(header, separators=(",", ":")).encode()
        views = [memoryview(p).cast("B") for p in parts]
        try:
            self.sock.sendall(_FRAME.pack(len(head), sum(len(v) for v in views)) + head)
            for view in views:
                for lo in range(0, len(view), SEND_PIECE):
                    piece = view[lo:lo + SEND_PIECE]
                    self.throttle.take(len(piece))
                    self.sock.sendall(piece)
        except OSError as exc:
            raise TransportError(f"sending to {self.peer} failed: {exc}") from exc
        self.sent += _FRAME.size + len(head) + sum(len(v) for v in views)

    def recv_header(self) -> tuple[dict[str, Any], int]:
        try:
            hlen, plen = _FRAME.unpack(_recv_exact(self.sock, _FRAME.size))
            if hlen > MAX_HEADER:
                raise TransportError(f"{self.peer} sent a {hlen}-byte header (limit {MAX_HEADER}); protocol error")
            header = json.loads(_recv_exact(self.sock, hlen))
        except RecursionError as exc:
            raise TransportError(f"{self.peer} sent a header nested too deeply to parse; protocol error") from exc
        except (OSError, ValueError) as exc:
            raise TransportError(f"receiving from {self.peer} failed: {exc}") from exc
        return received(header, self.peer), plen

    def recv_payload(self, into: np.ndarray) -> None:
        try:
            _recv_into(self.sock, memoryview(into).cast("B"))
        except OSError as exc:
            raise TransportError(f"receiving from {self.peer} failed: {exc}") from exc

    def tell(self, header: dict[str, Any]) -> None:
        with suppress(TransportError, OSError):
            self.sock.settimeout(NOTICE_S)
            self.send(header)

    def shutdown(self) -> None:
        with suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with suppress(OSError):
            self.sock.close()


class Listener:
    """A listening socket that hands out only authenticated channels (`accept`), the handshakes run by a thread of
    its own (`Handshakes`); strangers are refused, told so and logged."""

    def __init__(self, secret: bytes, host: str = "0.0.0.0", port: int = 0, backlog: int = 64,
                 throttle: Throttle | None = None, handshake_s: float = HANDSHAKE_S):
        self.secret = secret
        self.throttle = throttle
        self.sock = socket.create_server((host, port), backlog=backlog, reuse_port=False)
        self.address = self.sock.getsockname()[:2]
        self._ready: queue.Queue[Channel | None] = queue.Queue()
        self._handshakes = Handshakes(self.sock, secret, self._admit, handshake_s)
        self._thread = chore(self._handshakes.run, name=f"hpcft-accept-{self.port}")
        self._thread.start()

    @property
    def port(self) -> int:
        return self.address[1]

    @property
    def refused(self) -> int:
        """Connections refused so far (wrong secret, not an agent, too slow)."""
        return self._handshakes.refused

    def _admit(self, conn: socket.socket, peer: str) -> None:
        self._ready.put(Channel(conn, peer, self.throttle))

    def accept(self, timeout: float | None = None) -> Channel:
        """Wait for the next peer that proved the job secret (TransportError after `timeout` seconds)."""
        try:
            ch = self._ready.get(timeout=timeout)
        except queue.Empty:
            raise TransportError(f"no authenticated peer within {timeout} s on port {self.port}") from None
        if ch is None:
            self._ready.put(None)
            raise TransportError(f"listener on port {self.port} is closed")
        return ch

    def close(self) -> None:
        self._handshakes.stop()
        self._thread.join(5.0)
        self.sock.close()
        self._ready.put(None)
        while True:  # authenticated but never taken: close them
            try:
                ch = self._ready.get_nowait()
            except queue.Empty:
                break
            if ch is None:
                break
            ch.close()
        self._ready.put(None)


class _Pending:
    """One incoming connection in its handshake: what it must send, by when."""

    def __init__(self, conn: socket.socket, peer: str, deadline: float):
        self.conn, self.peer, self.deadline = conn, peer, deadline
        self.nonce = os.urandom(NONCE)
        self.buf = bytearray()


class Handshakes:
    """The server side of every incoming handshake, in one thread, none blocking another: by its deadline each
    connection is handed to `admit` or refused (told so, event `peer_refused`)."""

    REPLY = len(MAGIC) + NONCE + MAC

    def __init__(self, listen: socket.socket, secret: bytes, admit: Callable[[socket.socket, str], None],
                 handshake_s: float = HANDSHAKE_S, max_pending: int = MAX_PENDING):
        self.listen, self.secret, self.admit = listen, secret, admit
        self.handshake_s, self.max_pending = handshake_s, max_pending
        self.refused = 0
        self.port = listen.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopped = False
        self._pending: dict[socket.socket, _Pending] = {}

    def run(self) -> None:
        """The thread's loop, until `stop`: accept, read replies, refuse whoever's deadline passed."""
        self.listen.setblocking(False)
        self._sel.register(self.listen, selectors.EVENT_READ)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self._stopped:
                soonest = min((p.deadline for p in self._pending.values()), default=None)
                wait = None if soonest is None else max(0.0, soonest - time.monotonic())
                for key, _ in self._sel.select(wait):
                    if key.fileobj is self.listen:
                        self._accept()
                    elif key.fileobj in self._pending:
                        self._read(self._pending[key.fileobj])
                now = time.monotonic()
                for p in [p for p in self._pending.values() if p.deadline <= now]:
                    self._refuse(p, f"no complete handshake within {self.handshake_s:g} s")
        finally:
            for p in list(self._pending.values()):
                self._drop(p)
            self._sel.close()
            self._wake_r.close()
            self._wake_w.close()

    def stop(self) -> None:
        """End `run` (from another thread); connections still in their handshake are closed."""
        self._stopped = True
        with suppress(OSError):
            self._wake_w.send(b"x")

    def _accept(self) -> None:
        while True:
            try:
                conn, addr = self.listen.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. EMFILE: leave it in the backlog for the next round
                _log.warning("accept on port %d failed: %s", self.port, exc)
                return
            if len(self._pending) >= self.max_pending:  # the oldest is the likeliest to be stalling
                self._refuse(min(self._pending.values(), key=lambda p: p.deadline),
                             f"dropped: {self.max_pending} handshakes were in progress")
            p = _Pending(conn, f"{addr[0]}:{addr[1]}", time.monotonic() + self.handshake_s)
            conn.setblocking(False)
            try:
                conn.send(MAGIC + p.nonce)  # a few dozen bytes into a fresh socket's buffer: never partial
            except OSError as exc:
                conn.close()
                self._count(p.peer, f"sending the challenge failed: {exc}")
                continue
            self._pending[conn] = p
            self._sel.register(conn, selectors.EVENT_READ)

    def _read(self, p: _Pending) -> None:
        try:
            data = p.conn.recv(self.REPLY - len(p.buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._refuse(p, f"connection failed during the handshake: {exc}")
            return
        if not data:
            self._refuse(p, f"closed the connection after {len(p.buf)} of {self.REPLY} handshake bytes")
            return
        p.buf += data
        if len(p.buf) < self.REPLY:
            return
        reply = bytes(p.buf)
        if reply[:len(MAGIC)] != MAGIC:
            self._refuse(p, "not an hpcft agent (bad greeting)")
            return
        theirs, proof = reply[len(MAGIC):len(MAGIC) + NONCE], reply[len(MAGIC) + NONCE:]
        if not hmac.compare_digest(proof, _mac(self.secret, b"client", p.nonce, theirs)):
            self._refuse(p, "wrong job secret", tell=True)
            return
        self._forget(p)
        try:
            p.conn.setblocking(True)
            p.conn.sendall(ACCEPTED + _mac(self.secret, b"server", theirs, p.nonce))
        except OSError as exc:
            p.conn.close()
            self._count(p.peer, f"sending the proof failed: {exc}")
            return
        self.admit(p.conn, p.peer)

    def _refuse(self, p: _Pending, reason: str, tell: bool = False) -> None:
        self._count(p.peer, reason)
        if tell:
            with suppress(OSError):
                p.conn.send(REFUSED)
        self._drop(p)

    def _count(self, peer: str, reason: str) -> None:
        self.refused += 1
        events.emit("peer_refused", level=logging.WARNING, peer=peer, port=self.port, reason=reason)

    def _forget(self, p: _Pending) -> None:
        self._pending.pop(p.conn, None)
        with suppress(KeyError, ValueError):
            self._sel.unregister(p.conn)

    def _drop(self, p: _Pending) -> None:
        self._forget(p)
        p.conn.close()


def connect(secret: bytes, host: str, port: int, timeout: float = 30.0, throttle: Throttle | None = None) -> Channel:
    """Connect to a peer agent and run the mutual handshake (within HANDSHAKE_S); AuthError if the peer lacks the
    secret or refuses ours."""
    peer = f"{host}:{port}"
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise TransportError(f"cannot connect to agent at {peer}: {exc}") from exc
    deadline = time.monotonic() + HANDSHAKE_S
    try:
        hello = _recv_exact(sock, len(MAGIC) + NONCE, deadline)
        if hello[:len(MAGIC)] != MAGIC:
            raise AuthError(f"{peer} is not an hpcft agent")
        theirs, mine = hello[len(MAGIC):], os.urandom(NONCE)
        sock.sendall(MAGIC + mine + _mac(secret, b"client", theirs, mine))
        verdict = _recv_exact(sock, 1, deadline)
        if verdict == REFUSED:
            raise AuthError(f"{peer} refused this agent: it does not accept our job secret (is HPCFT_SECRET_FILE "
                            "this job's secret?)")
        if verdict != ACCEPTED:
            raise AuthError(f"{peer} is not an hpcft agent (bad verdict)")
        proof = _recv_exact(sock, MAC, deadline)
        if not hmac.compare_digest(proof, _mac(secret, b"server", mine, theirs)):
            raise AuthError(f"{peer} does not hold this job's secret")
    except (TransportError, OSError) as exc:
        sock.close()
        if isinstance(exc, AuthError):
            kind = "refused_by_peer" if "refused this agent" in str(exc) else "peer_refused"
            events.emit(kind, level=logging.WARNING, peer=peer, reason=str(exc))
            raise
        raise TransportError(f"handshake with {peer} failed: {exc}") from exc
    return Channel(sock, peer, throttle)
