"""The supervisor's report service: a connection per node's uplink, all read by one thread through a selector (the
agents' frames: a JSON header, no payload), each `report` handed to `take`. Not a tree over the agents: it would send
the same bytes over more hops only to save connections, and one epoll set holds 9,408 as easily as 8."""
from __future__ import annotations

import contextlib
import json
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from hpcft import events
from hpcft.agent.transport.rendezvous import BACKLOG, _raise_fd_limit
from hpcft.agent.transport.tcp import _FRAME, MAX_HEADER, Channel, Listener, TransportError

_log = logging.getLogger(__name__)
DRAIN_S = 2.0  # at close, the longest spent reading what the agents sent last
QUIET_S = 0.25  # … and the longest with nothing to read (a node whose agent still runs)
RECV_BUFFER = 64 << 10  # per connection: reports are small (the transport's default of 4 MiB is for bulk data)


class ReportServer:
    """Listens on `bind` (a port the kernel picks) as `address`; `take(report)` runs on the service's thread."""

    def __init__(self, secret: bytes, take: Callable[[dict[str, Any]], None], *, host: str = "127.0.0.1",
                 bind: str = "0.0.0.0"):
        _raise_fd_limit()
        self.take = take
        self.listener = Listener(secret, host=bind, backlog=BACKLOG)
        self.address = f"{host}:{self.listener.port}"
        self.received = 0  # reports taken (for tests and the scale figures)
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._new: list[Channel] = []
        self._orders: dict[str, Any] = {}  # {tag: what the supervisor asks of that launch's agents}, pushed (`order`)
        self._orders_sent = True
        self._lock = threading.Lock()
        self._stopped = False
        self._threads = [threading.Thread(target=self._accept, daemon=True, name="hpcft-reports-accept"),
                         threading.Thread(target=self._serve, daemon=True, name="hpcft-reports")]
        for t in self._threads:
            t.start()

    @property
    def connections(self) -> int:
        return len(self._sel.get_map()) - 1

    def _accept(self) -> None:
        while not self._stopped:
            try:
                ch = self.listener.accept(0.5)
            except TransportError:
                continue
            ch.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECV_BUFFER)
            ch.sock.setblocking(False)
            with self._lock:
                self._new.append(ch)
            self._wake_w.send(b"x")

    def _serve(self) -> None:
        while not self._stopped:
            self._pass(1.0)
        # the agents' last reports ("stopped") may still be buffered or on their way: read before the view's last
        # write, until each node closes (its agent ended), for at most DRAIN_S or until QUIET_S passes with nothing
        deadline = time.monotonic() + DRAIN_S
        while self.connections and time.monotonic() < deadline and self._pass(QUIET_S):
            pass

    def _pass(self, timeout: float) -> bool:
        """Serve what is ready within `timeout`; False if nothing was."""
        ready = self._sel.select(timeout)
        for key, _ in ready:
            if key.fileobj is self._wake_r:
                self._wake_r.recv(4096)
                with self._lock:
                    new, self._new = self._new, []
                    orders, resend = dict(self._orders), not self._orders_sent
                    self._orders_sent = True
                for ch in new:
                    self._sel.register(ch.sock, selectors.EVENT_READ, (ch, bytearray()))
                told = [k.data[0] for k in self._sel.get_map().values() if k.data is not None] if resend else new
                for ch in told if orders else ():
                    self._tell(ch, orders)
            else:
                self._read(*key.data)
        return bool(ready)

    def _read(self, ch: Channel, buf: bytearray) -> None:
        try:
            data = ch.sock.recv(RECV_BUFFER)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the node closed (its agent ended): what it said stays in the view
            self._drop(ch)
            return
        buf += data
        while len(buf) >= _FRAME.size:
            hlen, plen = _FRAME.unpack_from(buf)
            if hlen > MAX_HEADER or plen:
                events.emit("report_bad", level=logging.WARNING, peer=ch.peer,
                            reason=f"a frame of {hlen} header and {plen} payload bytes is no report")
                self._drop(ch)
                return
            if len(buf) < _FRAME.size + hlen:
                return
            raw = bytes(buf[_FRAME.size:_FRAME.size + hlen])
            del buf[:_FRAME.size + hlen]
            try:
                report = json.loads(raw)["report"]
                self.take(report)
                self.received += 1
            except (ValueError, KeyError, TypeError) as exc:
                events.emit("report_bad", level=logging.WARNING, peer=ch.peer, reason=f"unreadable report: {exc}")

    def order(self, tag: str, **asked: Any) -> None:
        """Ask the agents of launch `tag` (drain=True, stop=True, flush=<id>): pushed to every node connected now and
        to each that connects later, on its uplink (no request file for a node to poll on the shared file system)."""
        with self._lock:
            self._orders[tag] = {**self._orders.get(tag, {}), **asked}
            self._orders_sent = False
        self._wake_w.send(b"o")

    def _tell(self, ch: Channel, orders: dict[str, Any]) -> None:
        try:
            ch.sock.settimeout(1.0)  # a node that does not read is dropped, not waited for
            ch.send({"orders": orders})
        except (TransportError, OSError):
            self._drop(ch)
            return
        with contextlib.suppress(OSError):
            ch.sock.setblocking(False)

    def _drop(self, ch: Channel) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(ch.sock)
        ch.close()

    def close(self) -> None:
        self._stopped = True
        self._wake_w.send(b"x")
        for t in self._threads:
            t.join(5.0)
        for key in list(self._sel.get_map().values()):
            if key.data is not None:
                key.data[0].close()
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()
        self.listener.close()
