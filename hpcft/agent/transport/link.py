"""A mesh's connection to one peer agent, whatever carries it (TCP: tcp.Channel; MPI: mpilink.MpiLink): ordered
messages of a JSON header plus raw bytes, both ways, and the errors a broken one raises."""
from __future__ import annotations

import json
import math
import types
from collections.abc import Sequence
from typing import Any

import numpy as np

from hpcft.errors import HpcftError
from hpcft.nodemem import mem_available


class TransportError(HpcftError):
    """A peer connection failed, was refused, or broke the protocol; `peer_slot`, when known, is that agent's slot
    (the supervisor probes its node first)."""

    peer_slot: int | None = None


class ProtocolError(TransportError):
    """A peer sent a message that does not fit what the protocol expects at that point (`Link.check`)."""


class PeerGaveUp(TransportError):
    """The peer sent a give-up notice instead of the message expected: it lost the agent of `peer_slot`."""


NOTICE = "gave_up"  # the header key of a give-up notice (no payload)
COUNT = range(1 << 63)  # a step, a byte count, a slot: a non-negative JSON integer (as a `mismatch` spec)


class Either:
    """A `mismatch` spec that any one of `specs` fits."""

    def __init__(self, *specs: Any):
        self.specs = specs


def mismatch(value: Any, spec: Any, path: str = "") -> str | None:
    """What in `value` (parsed JSON) does not fit `spec`, or None. A spec: `object` (anything); a type or union (a bool
    is no int unless named, a float must be finite); a range (an int in it); `[item]` (a list of such); a tuple (a
    list of that many, each fitting its own); `{key: spec}` (those keys at least, each fitting); Either; else equal."""
    where = path or "the value"
    if spec is object:
        return None
    if isinstance(spec, Either):
        problems = [mismatch(value, s, path) for s in spec.specs]
        return None if None in problems else f"{where} is {_show(value)}, not {_describe(spec)}"
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            return f"{where} is {_show(value)}, not an object"
        for key, sub in spec.items():
            inner = f"{path}.{key}" if path else str(key)
            problem = f"{inner} is missing" if key not in value else mismatch(value[key], sub, inner)
            if problem:
                return problem
        return None
    if isinstance(spec, (list, tuple)):
        if not isinstance(value, list) or (isinstance(spec, tuple) and len(value) != len(spec)):
            return f"{where} is {_show(value)}, not {_describe(spec)}"
        subs = spec if isinstance(spec, tuple) else spec * len(value)
        return next(filter(None, (mismatch(v, s, f"{path}[{i}]") for i, (v, s) in enumerate(zip(value, subs)))), None)
    if _fits(value, spec):
        return None
    return f"{where} is {_show(value)}, not {_describe(spec)}"


def _fits(value: Any, spec: Any) -> bool:
    """`value` fits a scalar spec: a type or union, a range, or an exact value."""
    if isinstance(value, float) and not math.isfinite(value):  # json.loads takes NaN and Infinity
        return False
    if isinstance(spec, (type, types.UnionType)):
        named = spec.__args__ if isinstance(spec, types.UnionType) else (spec,)
        return isinstance(value, spec) and (bool in named or not isinstance(value, bool))
    if isinstance(spec, range):
        return type(value) is int and value in spec
    return type(value) is type(spec) and value == spec


def _describe(spec: Any) -> str:
    if isinstance(spec, Either):
        return "one of " + ", ".join(_describe(s) for s in spec.specs)
    if isinstance(spec, range):
        upto = "" if spec.stop >= COUNT.stop else f"..{spec.stop - 1}"
        return f"an integer in {spec.start}{upto}" if upto else f"an integer ≥ {spec.start}"
    if isinstance(spec, tuple):
        return f"a list of {len(spec)}"
    if isinstance(spec, list):
        return "a list"
    if isinstance(spec, dict):
        return "an object with " + ", ".join(map(str, spec)) if spec else "an object"
    if isinstance(spec, types.UnionType):
        return " or ".join(_describe(s) for s in spec.__args__)
    if isinstance(spec, type):
        return "null" if spec is type(None) else f"{'an' if spec.__name__[0] in 'aeiou' else 'a'} {spec.__name__}"
    return _show(spec)


def _show(value: Any) -> str:
    text = json.dumps(value, default=repr)
    return text if len(text) <= 80 else text[:77] + "..."


def notice(slot: int, lost: int, error: str) -> dict[str, Any]:
    """The header an agent sends its connections when it gives up: its slot, the slot it lost, why."""
    return {NOTICE: {"slot": slot, "lost": lost, "error": error[:2000]}}


def gave_up(header: Any, peer: str) -> PeerGaveUp | None:
    """The PeerGaveUp a received `header` stands for when it is a give-up notice, else None."""
    if not isinstance(header, dict) or not isinstance(header.get(NOTICE), dict):
        return None
    gave = header[NOTICE]
    err = PeerGaveUp(f"the agent of slot {gave.get('slot')} ({peer}) gave up: {gave.get('error')}")
    err.peer_slot = gave.get("lost") if mismatch(gave.get("lost"), COUNT) is None else None
    return err


def received(header: Any, peer: str) -> dict[str, Any]:
    """A parsed header as received: a JSON object (else a TransportError), a give-up notice raised as PeerGaveUp."""
    if not isinstance(header, dict):
        raise TransportError(f"{peer} sent a header that is not a JSON object")
    if (err := gave_up(header, peer)) is not None:
        raise err
    return header


class Link:
    """One peer's connection: messages in order both ways. A carrier implements `send_parts`, `recv_header`,
    `recv_payload`, `tell`, `shutdown` and `close`, and counts the bytes it sent in `sent`."""

    peer: str
    sent: int
    slot: int | None = None  # the peer's slot, once a mesh has keyed this link by it: its errors name it

    def send(self, header: dict[str, Any], payload: Any = None) -> None:
        """Send a JSON-able `header` and an optional bytes-like `payload`."""
        self.send_parts(header, () if payload is None else (payload,))

    def recv(self, into: np.ndarray | None = None, shape: Any = object,
             what: str = "a message") -> tuple[dict[str, Any], np.ndarray]:
        """The next message: its header, checked against `shape`, and payload (into `into[:n]`, else a new array)."""
        header, plen = self.recv_header()
        self.check(header, shape, what)
        if into is not None and into.size < plen:
            raise TransportError(f"{self.peer} sent {plen} bytes for a {into.size}-byte buffer")
        if into is None and plen > mem_available():
            raise TransportError(f"{self.peer} announced a {plen}-byte payload, more than this node's free memory; "
                                 "protocol error")
        try:
            out = into[:plen] if into is not None else np.empty(plen, dtype=np.uint8)
        except (MemoryError, ValueError) as exc:
            raise TransportError(f"no buffer for {self.peer}'s {plen}-byte payload: {exc}") from exc
        self.recv_payload(out)
        return header, out

    def check(self, message: Any, shape: Any, what: str = "a message") -> Any:
        """`message` (parsed JSON from this peer) when it fits `shape`, else a ProtocolError naming the peer."""
        problem = mismatch(message, shape)
        if problem is None:
            return message
        who = self.peer if self.slot is None else f"the agent of slot {self.slot} ({self.peer})"
        err = ProtocolError(f"{who} sent {what}: {problem}; protocol error")
        err.peer_slot = self.slot
        raise err

    def send_parts(self, header: dict[str, Any], parts: Sequence[Any]) -> None:
        """Send `header` and the concatenation of `parts` as one payload."""
        raise NotImplementedError

    def recv_header(self) -> tuple[dict[str, Any], int]:
        """The next message's header (PeerGaveUp for a give-up notice) and payload length, for `recv_payload`."""
        raise NotImplementedError

    def recv_payload(self, into: np.ndarray) -> None:
        """Exactly `into.size` bytes of the current message's payload, straight into `into`."""
        raise NotImplementedError

    def tell(self, header: dict[str, Any]) -> None:
        """Send a notice (`notice`) before shutting down: best effort, bounded in time, never raises."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """End the connection now: waits on it here and on the peer fail (from any thread)."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError
