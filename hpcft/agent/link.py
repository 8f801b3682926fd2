"""What a mesh's connection to one peer agent is, whatever carries it (TCP: transport.Channel; MPI: mpilink.MpiLink):
ordered messages of a JSON header plus raw bytes, both ways, and the errors a broken one raises. `send` and `recv`
are written once here, over each carrier's primitives."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from hpcft.errors import HpcftError
from hpcft.nodemem import mem_available


class TransportError(HpcftError):
    """A peer connection failed, was refused, or broke the protocol; `peer_slot`, when known, is the slot of the agent
    whose connection it was (the supervisor probes that node first: hpcft/launch/agents.py)."""

    peer_slot: int | None = None


class PeerGaveUp(TransportError):
    """The peer sent a give-up notice (`notice`) instead of the message expected: it failed, having lost the agent
    of `peer_slot`, and shuts its connections down."""


NOTICE = "gave_up"  # the header key of a give-up notice (no payload)


def notice(slot: int, lost: int, error: str) -> dict[str, Any]:
    """The header an agent sends its connections when it gives up: its slot, the slot it lost, why."""
    return {NOTICE: {"slot": slot, "lost": lost, "error": error[:2000]}}


def gave_up(header: Any, peer: str) -> PeerGaveUp | None:
    """The PeerGaveUp a received `header` stands for when it is a give-up notice, else None."""
    if not isinstance(header, dict) or not isinstance(header.get(NOTICE), dict):
        return None
    gave = header[NOTICE]
    err = PeerGaveUp(f"the agent of slot {gave.get('slot')} ({peer}) gave up: {gave.get('error')}")
    err.peer_slot = gave.get("lost") if isinstance(gave.get("lost"), int) else None
    return err


class Link:
    """One peer's connection: messages in order both ways. A carrier implements `send_parts`, `recv_header`,
    `recv_payload`, `tell`, `shutdown` and `close`, and counts the bytes it sent in `sent`."""

    peer: str
    sent: int

    def send(self, header: dict[str, Any], payload: Any = None) -> None:
        """Send a JSON-able `header` and an optional bytes-like `payload`."""
        self.send_parts(header, () if payload is None else (payload,))

    def recv(self, into: np.ndarray | None = None) -> tuple[dict[str, Any], np.ndarray]:
        """The next message: its header and payload (written into `into[:n]` when given, else a new array)."""
        header, plen = self.recv_header()
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

    def send_parts(self, header: dict[str, Any], parts: Sequence[Any]) -> None:
        """Send `header` and the concatenation of `parts` as one payload."""
        raise NotImplementedError

    def recv_header(self) -> tuple[dict[str, Any], int]:
        """The next message's header and payload length (PeerGaveUp for a give-up notice); read the payload with
        `recv_payload`, in parts if wanted."""
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
