"""The GPU copy level shared by the torch and hip backends: an issuer thread with a cap on bytes in
flight, a per-chunk completion event, a checksum per chunk once it has landed in host memory (on a
small pool of threads: one thread's crc32c is slower than a device→host DMA, and must not throttle it).

A backend supplies four primitives (`_record_ready`, `_copy`, `_record`, `_synchronize`) and the
device-side wait used by `guard`; everything else lives here once, including every event's lifetime: each
event a snapshot creates is released (`_release`) once its last user is done with it, on success and on
failure alike, so a long run holds no more events than one snapshot needs.
"""
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch

from hpcft.errors import CheckpointError
from hpcft.snapshot.plan import Chunk
from hpcft.store import Slot, crc32c


class StreamTransfer:
    """Issued asynchronously; `done_event` is recorded on the copy stream after the last chunk."""

    def __init__(self, sources: Sequence[torch.Tensor]):
        self.sources = sources  # kept alive until the copy is done
        self.issued = threading.Event()
        self.done_event: Any = None
        self.future: Future | None = None

    def done(self) -> bool:
        return self.future is not None and self.future.done()

    def result(self, timeout: float | None = None) -> list[int]:
        crcs = self.future.result(timeout)
        self.sources = ()
        return crcs


class StreamCopier:
    """Base of the device backends; subclasses implement the primitives below."""

    name = "stream"
    chunk_bytes = 4 << 20  # checksum granularity; copies are merged across chunks regardless
    overlap = True  # the device copies on its side stream while the next step runs
    event_bytes = 64 << 20  # one completion event per this many bytes (at most a quarter of the cap)

    def __init__(self, max_inflight_bytes: int = 256 << 20, crc_threads: int = 2):
        self.cap = max_inflight_bytes
        self._issuer = ThreadPoolExecutor(1, thread_name_prefix="hpcft-issue")
        self._crc = ThreadPoolExecutor(max(1, crc_threads), thread_name_prefix="hpcft-crc")
        self._pinned: dict[str, tuple[int, int, int]] = {}  # slot path -> (generation, ptr, size)
        self._host_plan: tuple[Sequence[Chunk], set[int], list] | None = None

    # primitives -------------------------------------------------------------------------------------
    def _register(self, ptr: int, size: int) -> None: raise NotImplementedError
    def _unregister(self, ptr: int) -> None: raise NotImplementedError
    def _record_ready(self) -> Any: raise NotImplementedError          # on the compute stream
    def _wait_ready(self, ready: Any) -> None: raise NotImplementedError  # copy stream waits on it
    def _copy(self, host: torch.Tensor, offset: int, src: torch.Tensor, start: int, nbytes: int) -> None:
        raise NotImplementedError
    def _record(self) -> Any: raise NotImplementedError                 # an event on the copy stream
    def _synchronize(self, event: Any) -> None: raise NotImplementedError
    def _compute_waits(self, event: Any) -> None: raise NotImplementedError
    def _release(self, event: Any) -> None: pass  # free an event nothing uses any more (torch's free themselves)

    def _on_host(self, t: torch.Tensor) -> bool:
        """State the host itself updates (e.g. the optimizer's step counters of GPU parameters live on the
        CPU): no device event orders those updates, so such bytes are copied at once, in `start`."""
        return t.device.type == "cpu"

    # shared logic -----------------------------------------------------------------------------------
    def _pin(self, slot: Slot) -> torch.Tensor:
        key = str(slot.path)
        host = torch.from_numpy(slot.array)
        ptr = host.data_ptr()
        held = self._pinned.get(key)
        if held is None or held[0] != slot.generation:
            if held is not None:
                del self._pinned[key]  # forgotten first: an unregistration that fails is not tried twice
                self._unregister(held[1])
            self._register(ptr, slot.size)
            self._pinned[key] = (slot.generation, ptr, slot.size)
        return host

    def start(self, sources: Sequence[torch.Tensor], chunks: Sequence[Chunk], slot: Slot) -> StreamTransfer:
        host = self._pin(slot)
        on_host, segments = self._host_segments(sources, chunks)
        for s in segments:
            host[s.offset:s.offset + s.nbytes].copy_(sources[s.source][s.start:s.start + s.nbytes])
        ready = self._record_ready()
        transfer = StreamTransfer(sources)
        transfer.future = self._issuer.submit(self._issue, transfer, chunks, slot, host, ready, on_host)
        return transfer

    def _host_segments(self, sources: Sequence[torch.Tensor], chunks: Sequence[Chunk]) -> tuple[set[int], list]:
        """The host-resident sources and their segments, kept while the engine passes the same chunk list (it
        caches one per layout), so the training thread does not walk every chunk at every snapshot."""
        if self._host_plan is None or self._host_plan[0] is not chunks:
            on_host = {i for i, t in enumerate(sources) if self._on_host(t)}
            self._host_plan = (chunks, on_host, [s for c in chunks for s in c.segments if s.source in on_host])
        return self._host_plan[1], self._host_plan[2]

    def _issue(self, transfer: StreamTransfer, chunks: Sequence[Chunk], slot: Slot, host: torch.Tensor,
               ready: Any, on_host: set[int]) -> list[int]:
        """Issue the device bytes as few, large copies (a tensor's consecutive segments merged across
        chunks), one completion event per `event_bytes`; checksum chunks as their event completes."""
        crcs: list[Future | None] = [None] * len(chunks)
        inflight: deque = deque()  # (event, chunks [landed, upto) complete with it, bytes)
        landed = 0

        def land() -> int:  # those chunks are in host memory: their bytes no longer count as in flight
            nonlocal landed
            event, upto, nbytes = inflight.popleft()
            try:
                self._synchronize(event)
            finally:
                self._release(event)
            for j in range(landed, upto):
                c = chunks[j]
                crcs[j] = self._crc.submit(crc32c, slot.array[c.offset:c.offset + c.nbytes])
            landed = upto
            return nbytes

        try:
            self._issue_all(transfer, chunks, host, ready, on_host, inflight, land)
            while inflight:
                land()
        finally:  # what a failure left in flight: nothing will wait on those events
            while inflight:
                self._release(inflight.popleft()[0])
        return [f.result() for f in crcs]

    def _issue_all(self, transfer: StreamTransfer, chunks: Sequence[Chunk], host: torch.Tensor, ready: Any,
                   on_host: set[int], inflight: deque, land: Callable[[], int]) -> None:
        """Issue every copy after `ready`, an event per `event_bytes` into `inflight`, then the transfer's
        done event (recorded even after a failure, so that the next step still waits for what was issued)."""
        every = max(1, min(self.event_bytes, self.cap // 4))
        try:
            try:
                self._wait_ready(ready)
            finally:
                self._release(ready)
            run: list[int] | None = None  # [source, start, offset, nbytes] still being extended
            pending = since = 0
            for i, chunk in enumerate(chunks):
                for s in chunk.segments:
                    if s.source in on_host:
                        continue
                    if run and run[0] == s.source and run[1] + run[3] == s.start and run[2] + run[3] == s.offset:
                        run[3] += s.nbytes
                        continue
                    if run:
                        self._copy(host, run[2], transfer.sources[run[0]], run[1], run[3])
                    run = [s.source, s.start, s.offset, s.nbytes]
                since += chunk.nbytes
                if since >= every or i == len(chunks) - 1:
                    if run:
                        self._copy(host, run[2], transfer.sources[run[0]], run[1], run[3])
                        run = None
                    inflight.append((self._record(), i + 1, since))
                    pending, since = pending + since, 0
                    while pending > self.cap and len(inflight) > 1:
                        pending -= land()
            transfer.done_event = self._record()
        finally:
            if transfer.done_event is None:  # failed mid-way: still order the next step after what was issued
                try:
                    transfer.done_event = self._record()
                except Exception:  # the device is gone; guard falls back to a host wait
                    pass
            transfer.issued.set()

    def guard(self, transfer: StreamTransfer) -> None:
        """Device-side: the compute stream waits for the copy's last event; the host waits only while
        chunks are still being issued (a copy later than the whole forward/backward)."""
        transfer.issued.wait()
        if transfer.done_event is None:
            transfer.result()  # no event to wait on: wait on the host and raise the copy's error here
            raise CheckpointError("snapshot copy ended without a completion event")
        try:
            self._compute_waits(transfer.done_event)
        finally:  # its last user: the issuer is done with it once `issued` is set
            self._release(transfer.done_event)

    def close(self) -> None:
        self._issuer.shutdown(wait=True)
        self._crc.shutdown(wait=True)
        pinned, self._pinned = list(self._pinned.values()), {}
        failed = []
        for _, ptr, _ in pinned:  # every one, even after one failed
            try:
                self._unregister(ptr)
            except Exception as exc:
                failed.append(exc)
        if failed:
            raise failed[0]
