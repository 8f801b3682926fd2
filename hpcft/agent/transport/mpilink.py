"""A mesh's connection to one peer agent over MPI point-to-point messages. A message is a frame (header length,
payload length, the JSON header's first SMALL bytes; a long header's rest follows in a second message), then the payload
in PIECE-sized messages cut at fixed offsets, taken straight into the receiver's buffer. Notices (give-up, shutdown)
have a tag of their own and fail whatever waits on this peer: MPI has no end of stream. A receive an abort fails is
cancelled, but one MPI already matched may still land in its buffer, so after an abort the agent exits."""
from __future__ import annotations

import json
import struct
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import suppress
from typing import Any

import numpy as np

from hpcft.agent.transport.link import Link, TransportError, gave_up, received
from hpcft.agent.transport.mpiworld import Op, World
from hpcft.agent.transport.throttle import Throttle
from hpcft.agent.transport.tcp import MAX_HEADER, NOTICE_S

DATA, NOTICES = 1, 2  # tags
FRAME = struct.Struct("!IQ")  # header length, payload length
SMALL = 64 << 10  # the first message of a frame: posted for every header, so a typical one arrives in one message
PIECE = 1 << 20  # payload message size: the parity fold's receive size (protect.RECV_PIECE), so it needs no staging
WINDOW = 32  # payload messages in flight per call
CLOSED = "closed"  # the notice of a shutdown


def pieces(parts: Sequence[Any], piece: int = PIECE) -> Iterator[np.ndarray]:
    """The concatenation of `parts` cut every `piece` bytes: views, or a copy where a piece spans several parts."""
    views = [np.frombuffer(memoryview(p).cast("B"), dtype=np.uint8) for p in parts]
    views = [v for v in views if v.size]
    i, off = 0, 0
    while i < len(views):
        v = views[i]
        if v.size - off >= piece or i == len(views) - 1:
            end = min(v.size, off + piece)
            yield v[off:end]
            i, off = (i, end) if end < v.size else (i + 1, 0)
            continue
        buf, got = np.empty(piece, dtype=np.uint8), 0
        while i < len(views) and got < piece:
            n = min(piece - got, views[i].size - off)
            buf[got:got + n] = views[i][off:off + n]
            got, off = got + n, off + n
            if off == views[i].size:
                i, off = i + 1, 0
        yield buf[:got]


class MpiLink(Link):
    """Messages to and from MPI rank `rank` of `comm`, in order both ways (one thread a direction at a time)."""

    def __init__(self, world: World, comm: Any, rank: int, peer: str, throttle: Throttle | None = None):
        self.world, self.comm, self.rank, self.peer = world, comm, rank, peer
        self.throttle = throttle or Throttle(None)
        self.sent = 0
        self._gone: TransportError | None = None
        self._pending: set[Op] = set()
        self._small = np.empty(SMALL, dtype=np.uint8)
        self._left = 0  # payload bytes of the current message not yet received
        self._spill = np.empty(0, dtype=np.uint8)  # a received piece's bytes not yet asked for
        self._notice = np.empty(4096, dtype=np.uint8)
        self._call(lambda MPI, c: c.Irecv([self._notice, MPI.BYTE], source=rank, tag=NOTICES), "notice receive",
                   idle=True, on_done=self._noticed, track=False)

    def send_parts(self, header: dict[str, Any], parts: Sequence[Any]) -> None:
        head = json.dumps(header, separators=(",", ":")).encode()
        plen = sum(memoryview(p).nbytes for p in parts)
        frame = np.frombuffer(FRAME.pack(len(head), plen) + head, dtype=np.uint8)
        # not waited for, so that two agents sending each other a large header first (an all-gather's round)
        # cannot deadlock in MPI's rendezvous, as they do not on TCP
        messages = [frame[:SMALL]] + ([frame[SMALL:]] if frame.size > SMALL else [])

        def payload() -> Iterator[np.ndarray]:
            for p in pieces(parts):
                self.throttle.take(p.size)
                yield p

        if self._gone is not None:
            raise self._gone
        for m in messages:  # this call's own copy of the frame, as TCP's socket buffer takes it
            self._isend(m, track=False, on_done=self._frame_sent)
        self._pipeline("send", (self._isend(p) for p in payload()))
        self.sent += frame.size + plen

    def _isend(self, buf: np.ndarray, **kw: Any) -> Op:
        return self._call(lambda MPI, c: c.Isend([buf, MPI.BYTE], dest=self.rank, tag=DATA), f"send to {self.peer}",
                          **kw)

    def _frame_sent(self, op: Op) -> None:
        if op.error is not None:
            self._fail(op.error)

    def recv_header(self) -> tuple[dict[str, Any], int]:
        if self._left:
            raise TransportError(f"{self.peer}: a new message asked for with {self._left} payload bytes of the last "
                                 "one unread; protocol error")
        got = self._wait(self._irecv(self._small))
        if got < FRAME.size:
            raise TransportError(f"{self.peer} sent a {got}-byte frame; protocol error")
        hlen, plen = FRAME.unpack(self._small[:FRAME.size].tobytes())
        if hlen > MAX_HEADER:
            raise TransportError(f"{self.peer} sent a {hlen}-byte header (limit {MAX_HEADER}); protocol error")
        head = self._small[FRAME.size:got].tobytes()
        if len(head) < hlen:
            rest = np.empty(hlen - len(head), dtype=np.uint8)
            if self._wait(self._irecv(rest)) != rest.size:
                raise TransportError(f"{self.peer} sent a header shorter than it announced; protocol error")
            head += rest.tobytes()
        try:
            header = json.loads(head[:hlen])
        except (ValueError, RecursionError) as exc:
            raise TransportError(f"{self.peer} sent a header that is not JSON ({exc}); protocol error") from exc
        self._left, self._spill = plen, np.empty(0, dtype=np.uint8)
        return received(header, self.peer), plen

    def recv_payload(self, into: np.ndarray) -> None:
        into = into.reshape(-1).view(np.uint8)
        if into.size > self._left + self._spill.size:
            raise TransportError(f"{self.peer}: {into.size} bytes asked for, {self._left + self._spill.size} left "
                                 "in the message; protocol error")
        pos = min(into.size, self._spill.size)
        into[:pos] = self._spill[:pos]
        self._spill = self._spill[pos:]
        ranges, left = [], self._left
        while left and pos < into.size and into.size - pos >= min(PIECE, left):  # whole pieces: straight in
            n = min(PIECE, left)
            ranges.append((pos, n))
            pos, left = pos + n, left - n
        self._pipeline("receive", (self._piece(into[lo:lo + n]) for lo, n in ranges))
        if pos < into.size:  # a piece only partly asked for: the rest of it waits in `_spill`
            buf = np.empty(min(PIECE, self._left), dtype=np.uint8)
            self._wait(self._piece(buf))
            into[pos:] = buf[:into.size - pos]
            self._spill = buf[into.size - pos:]

    def _piece(self, buf: np.ndarray) -> Op:
        self._left -= buf.size
        op = self._irecv(buf)
        op.expect = buf.size
        return op

    def _irecv(self, buf: np.ndarray) -> Op:
        return self._call(lambda MPI, c: c.Irecv([buf, MPI.BYTE], source=self.rank, tag=DATA),
                          f"receive from {self.peer}")

    def tell(self, header: dict[str, Any]) -> None:
        if self._gone is not None:
            return
        data = np.frombuffer(json.dumps(header, separators=(",", ":")).encode()[:self._notice.size], dtype=np.uint8)
        op = self._call(lambda MPI, c: c.Isend([data, MPI.BYTE], dest=self.rank, tag=NOTICES), "notice", track=False)
        with suppress(TransportError):
            op.wait(NOTICE_S)

    def shutdown(self) -> None:
        if self._gone is None:
            self.tell({CLOSED: 1})
        self._fail(TransportError(f"the connection to {self.peer} was shut down"))

    def close(self) -> None:
        self._fail(TransportError(f"the connection to {self.peer} is closed"))

    def _noticed(self, op: Op) -> None:
        """The peer told this agent it stops (in the MPI thread): everything waiting on it fails."""
        if op.error is not None:
            return
        try:
            header = json.loads(self._notice[:op.count].tobytes())
        except ValueError:
            header = {}
        err = gave_up(header, self.peer) or TransportError(f"{self.peer} shut its connections down")
        self._fail(err)

    def _fail(self, exc: TransportError) -> None:
        if self._gone is None:
            self._gone = exc
        for op in list(self._pending):
            if op.fail(exc):
                self.world.cancel(op)

    def _call(self, post, what: str, *, idle: bool = False, on_done=None, track: bool = True) -> Op:
        if track and self._gone is not None:
            raise self._gone
        op = self.world.call(post, what, idle=idle, on_done=on_done)
        if track:
            self._pending.add(op)
        return op

    def _wait(self, op: Op) -> int:
        try:
            n = op.wait()
        except TransportError as exc:  # shared by every op it failed: each waiting thread raises its own
            again = type(exc)(str(exc))
            again.peer_slot = exc.peer_slot
            raise again from None
        finally:
            self._pending.discard(op)
        expect = op.expect
        if expect is not None and n != expect:
            raise TransportError(f"{self.peer} sent a {n}-byte piece where {expect} were due; protocol error")
        return n

    def _pipeline(self, what: str, ops: Iterator[Op]) -> None:
        """Post `ops` keeping at most WINDOW in flight; all done, or the first failure raised (the rest failed)."""
        flight: deque[Op] = deque()
        try:
            for op in ops:
                flight.append(op)
                if len(flight) >= WINDOW:
                    self._wait(flight.popleft())
            while flight:
                self._wait(flight.popleft())
        except BaseException:
            for op in flight:
                if op.fail(TransportError(f"{what} with {self.peer} abandoned")):
                    self.world.cancel(op)
                self._pending.discard(op)
            raise
