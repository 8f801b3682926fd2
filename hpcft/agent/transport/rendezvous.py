"""How the agents of one job learn each other's addresses: each registers (launch tag, slot, address) at a directory
service, answered once the slots it asked for have registered. `hpcft run` serves it (HPCFT_AGENT_DIRECTORY), else
slot 0's agent, publishing its address in one file: no agent polls per-peer files on the shared file system."""
from __future__ import annotations

import ipaddress
import logging
import os
import resource
import socket
import threading
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from hpcft import events
from hpcft.agent.transport.iface import iface_address
from hpcft.agent.transport.link import COUNT, Either
from hpcft.agent.transport.tcp import HANDSHAKE_S, Channel, Listener, TransportError, connect
from hpcft.store.paths import replace_file

ENV = "HPCFT_AGENT_DIRECTORY"  # host[,host…]:port of the job's directory (exported by hpcft run)
TRY_S = 5.0  # the most one of the directory's addresses may take to answer before the next is tried
BACKLOG = 4096  # every agent of a launch registers at once (twice: its data mesh and its heartbeats)
REGISTER = {"register": {"tag": str, "slot": COUNT, "addr": str}, "want": [COUNT], "timeout": int | float}
_log = logging.getLogger(__name__)


def bootstrap_path(rendezvous: str | os.PathLike, tag: str) -> Path:
    """Where the agent of slot 0 publishes the address of the directory it serves (no HPCFT_AGENT_DIRECTORY)."""
    return Path(rendezvous) / f"agent-{tag}-directory"


@dataclass
class _Ask:
    """One registered agent waiting for the addresses of `want` (those in `missing` have not registered yet)."""
    ch: Channel
    tag: str
    want: list[int]
    deadline: float
    missing: set[int] = field(default_factory=set)


def addresses(iface: str | None = None) -> list[str]:
    """Where other nodes may reach a service on this host, best first: `iface`'s address; else the hostname's (it may
    be 127.0.1.1), then every other IPv4 address, loopback last (which network the nodes reach is not known here)."""
    if iface and (addr := iface_address(iface)):
        return [addr]
    found: list[str] = []
    with suppress(OSError):
        found.append(socket.gethostbyname(socket.gethostname()))
    found += [a for _, name in socket.if_nameindex() if (a := iface_address(name))]
    unique = list(dict.fromkeys(found)) or ["127.0.0.1"]
    return sorted(unique, key=lambda a: ipaddress.ip_address(a).is_loopback)


class Directory:
    """The directory service, one thread answering every registration; `address` is what agents are given: `host`
    (one address, or several separated by commas, tried in turn) and its port."""

    def __init__(self, secret: bytes, *, host: str = "127.0.0.1", bind: str = "0.0.0.0", port: int = 0):
        _raise_fd_limit()
        self.listener = Listener(secret, host=bind, port=port, backlog=BACKLOG)
        self.address = f"{host}:{self.listener.port}"
        self.known: dict[tuple[str, int], str] = {}
        self._waiting: dict[tuple[str, int], list[_Ask]] = {}
        self._asks: list[_Ask] = []
        self._lock = threading.Lock()  # `forget` comes from the supervisor's thread
        self._stopped = False
        self._thread = threading.Thread(target=self._serve, daemon=True, name=f"hpcft-directory-{self.listener.port}")
        self._thread.start()

    def _serve(self) -> None:
        while not self._stopped:
            try:
                ch = self.listener.accept(0.5)
            except TransportError:
                self._expire(time.monotonic())
                continue
            try:
                with self._lock:
                    self._take(ch)
            except TransportError as exc:
                events.emit("directory_bad_request", level=logging.WARNING, peer=ch.peer, error=str(exc))
                ch.close()
            self._expire(time.monotonic())

    def _take(self, ch: Channel) -> None:
        ch.sock.settimeout(HANDSHAKE_S)
        header, _ = ch.recv(shape=REGISTER, what="a registration")
        reg, want = header["register"], header["want"]
        tag, slot = reg["tag"], reg["slot"]
        ch.sock.settimeout(None)
        self.known[(tag, slot)] = reg["addr"]
        missing = {j for j in want if (tag, j) not in self.known}
        ask = _Ask(ch, tag, want, time.monotonic() + header["timeout"], missing)
        for other in self._waiting.pop((tag, slot), []):
            other.missing.discard(slot)
            if not other.missing:
                self._answer(other)
        if ask.missing:
            self._asks.append(ask)
            for j in ask.missing:
                self._waiting.setdefault((tag, j), []).append(ask)
        else:
            self._answer(ask)

    def _answer(self, ask: _Ask) -> None:
        with suppress(TransportError):
            ask.ch.send({"peers": {str(j): self.known[(ask.tag, j)] for j in ask.want if (ask.tag, j) in self.known},
                         "missing": sorted(ask.missing)})
        ask.ch.close()

    def forget(self, tag: str) -> None:
        """Drop what the agents of launch `tag` registered (a launch reusing a tag must not meet the dead)."""
        with self._lock:
            self.known = {k: v for k, v in self.known.items() if k[0] != tag}

    def _expire(self, now: float) -> None:
        """Answer the asks whose time ran out with what is known (the agent then names the missing slots)."""
        with self._lock:
            for a in [a for a in self._asks if a.missing and a.deadline <= now]:
                self._answer(a)
                a.missing = set()
            self._asks = [a for a in self._asks if a.missing]

    def close(self) -> None:
        self._stopped = True
        self._thread.join(5.0)
        for a in self._asks:
            a.ch.close()
        self.listener.close()


class Rendezvous:
    """An agent's side of the directory at `address` (host:port); `served`: the Directory this agent runs itself
    (slot 0 without HPCFT_AGENT_DIRECTORY), closed with it."""

    def __init__(self, address: str, secret: bytes, served: Directory | None = None, how: str = ENV):
        self.address, self.secret, self.served, self.how = address, secret, served, how

    def meet(self, tag: str, slot: int, addr: str, want: list[int], timeout: float) -> dict[int, str]:
        """Register `slot` of launch `tag` at `addr`; the addresses of `want` once registered. TransportError naming
        the directory (unreachable) or the slots that did not register within `timeout`."""
        ch = self._connect(timeout)
        try:
            ch.send({"register": {"tag": tag, "slot": slot, "addr": addr}, "want": want, "timeout": timeout})
            ch.sock.settimeout(timeout + HANDSHAKE_S)
            header, _ = ch.recv()
        except TransportError as exc:
            raise TransportError(f"the agents' directory at {self.address} did not answer slot {slot}: {exc}") from exc
        finally:
            ch.close()
        ch.check(header, {"missing": [Either(*want)], "peers": dict}, "its answer")
        if header["missing"]:
            err = TransportError(f"the agents of slots {header['missing']} did not register at the directory "
                                 f"{self.address} within {timeout:g} s; are they running?")
            err.peer_slot = header["missing"][0]
            raise err
        ch.check(header, {"peers": {str(j): str for j in want}}, "its answer")
        return {j: header["peers"][str(j)] for j in want}

    def _connect(self, timeout: float) -> Channel:
        """A channel to the directory: its addresses tried in turn (the one that answers is kept first)."""
        hosts, _, port = self.address.rpartition(":")
        failed = []
        for host in filter(None, hosts.split(",")):
            try:
                ch = connect(self.secret, host, int(port), timeout=min(timeout, TRY_S))
            except (TransportError, ValueError) as exc:
                failed.append(str(exc))
                continue
            self.address = f"{host}:{port}"
            return ch
        raise TransportError(f"cannot reach the agents' directory at {self.address} ({self.how}): "
                             f"{'; '.join(failed) or 'no address'}; is the process serving it (hpcft run on the batch "
                             "host, or the agent of slot 0) running, and is its address reachable from this node?")

    def close(self) -> None:
        if self.served is not None:
            self.served.close()


def join(secret: bytes, rendezvous: str | os.PathLike, *, slot: int, tag: str, host: str, bind: str,
         timeout: float, directory: str | None = None) -> Rendezvous:
    """The job's directory: `directory` (default $HPCFT_AGENT_DIRECTORY) when given; else the agent of slot 0 serves
    one and publishes its address in `bootstrap_path`, which the others read (one small file, once)."""
    directory = directory or os.environ.get(ENV)
    if directory:
        return Rendezvous(directory, secret)
    path = bootstrap_path(rendezvous, tag)
    if slot == 0:
        served = Directory(secret, host=host, bind=bind)
        replace_file(path, served.address.encode())
        return Rendezvous(served.address, secret, served, how="served by this agent")
    deadline = time.monotonic() + timeout
    while True:
        try:
            return Rendezvous(path.read_text().strip(), secret, how=f"published by the agent of slot 0 in {path}")
        except FileNotFoundError:
            if time.monotonic() > deadline:
                err = TransportError(f"the agent of slot 0 did not publish its directory's address ({path}) within "
                                     f"{timeout:g} s; is it running? (hpcft run exports {ENV} instead)")
                err.peer_slot = 0
                raise err from None
            time.sleep(0.05)


def _raise_fd_limit() -> None:
    """A directory holds one connection per waiting agent: lift the soft descriptor limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))
        except (ValueError, OSError):
            _log.warning("could not raise the open-file limit above %d", soft)
