"""The GPU copy level shared by the torch and hip backends: an issuer thread with a cap on bytes in flight,
completion events, and each chunk's checksum, computed by the device before the copy (hpcft.snapshot.devcrc) where
that kernel runs, else on a pool of host threads once the chunk landed (one thread's crc32c is slower than a
device→host DMA; four still hold an H200's copy to half its speed). A backend supplies the primitives below;
everything else is here once, including every event's lifetime: each is released (`_release`) once its last user is
done with it, on success and failure alike."""
import contextlib
import logging
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, ContextManager, Sequence

import numpy as np
import torch

from hpcft import events
from hpcft.errors import CheckpointError
from hpcft.snapshot import devcrc
from hpcft.snapshot.copiers.base import SlotClaim
from hpcft.snapshot.plan import Chunk, layout
from hpcft.snapshot.plan import chunks as plan_chunks
from hpcft.store import Slot, crc32c

_log = logging.getLogger(__name__)


class StreamTransfer:
    """Issued asynchronously; `done_event` is recorded on the copy stream after the last chunk."""

    def __init__(self, sources: Sequence[torch.Tensor]):
        self.sources = sources  # kept alive until the copy is done
        self.issued = threading.Event()
        self.done_event: Any = None
        self.future: Future | None = None

    def result(self, timeout: float | None = None) -> list[int]:
        crcs = self.future.result(timeout)
        self.sources = ()
        return crcs


class _Staged:
    """Host-resident segments gathered by one `torch.cat` at the boundary, placed into the slot by the issuer."""

    def __init__(self, sources: Sequence[torch.Tensor], segments: Sequence[Any]):
        self.sources = [sources[s.source][s.start:s.start + s.nbytes] for s in segments]
        self.buffer = torch.empty(sum(s.nbytes for s in segments), dtype=torch.uint8)
        self._array = self.buffer.numpy()
        los = np.cumsum([0] + [s.nbytes for s in segments])
        self._moves = [(int(lo), s.offset, s.nbytes) for lo, s in zip(los, segments)]

    def place(self, slot: np.ndarray) -> None:
        for lo, offset, nbytes in self._moves:
            slot[offset:offset + nbytes] = self._array[lo:lo + nbytes]


class StreamCopier:
    """Base of the device backends; subclasses implement the primitives below."""

    name = "stream"
    chunk_bytes = 4 << 20  # checksum granularity; copies are merged across chunks regardless
    overlap = True  # the device copies on its side stream while the next step runs
    event_bytes = 64 << 20  # one completion event per this many bytes (at most a quarter of the cap)

    def __init__(self, max_inflight_bytes: int = 256 << 20, crc_threads: int = 2,
                 device_crc: devcrc.DeviceCrc | None = None):
        self.cap = max_inflight_bytes
        self._issuer = ThreadPoolExecutor(1, thread_name_prefix="hpcft-issue")
        self._crc = ThreadPoolExecutor(max(1, crc_threads), thread_name_prefix="hpcft-crc")
        self._pinned: dict[str, tuple[int, int, int]] = {}  # slot path -> (generation, ptr, size)
        self._host_plan: tuple[Sequence[Chunk], set[int], _Staged | None] | None = None
        self.device_crc = device_crc  # None: the host checksums what lands
        self._crc_plan: tuple[Sequence[Chunk], Sequence[torch.Tensor], devcrc.Plan] | None = None
        self._zeroed: dict[str, tuple[int, Sequence[Chunk]]] = {}  # slot path -> (generation, chunks) whose gaps are 0

    @property
    def checksums(self) -> str:
        """Where chunk checksums are computed: 'device' (before the copy) or 'host' (after it)."""
        return "device" if self.device_crc is not None else "host"

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
    def _on_copy_stream(self) -> ContextManager: return contextlib.nullcontext()  # torch's stream := the copy stream

    def _on_host(self, t: torch.Tensor) -> bool:
        """State the host itself updates (e.g. the optimizer's step counters of GPU parameters live on the
        CPU): no device event orders those updates, so such bytes are gathered at once, in `start`."""
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

    def start(self, sources: Sequence[torch.Tensor], chunks: Sequence[Chunk], claim: SlotClaim) -> StreamTransfer:
        """At the boundary only the host-held bytes and the ready event; the issuing thread does the rest."""
        on_host, staged = self._host_copies(sources, chunks)
        if staged is not None:  # one call for the ~100 step counters of a 200M-parameter AdamW; the issuer places them
            torch.cat(staged.sources, out=staged.buffer)
        ready = self._record_ready()
        transfer = StreamTransfer(sources)
        transfer.future = self._issuer.submit(self._issue, transfer, chunks, claim, ready, on_host, staged)
        return transfer

    def _host_copies(self, sources: Sequence[torch.Tensor],
                     chunks: Sequence[Chunk]) -> tuple[set[int], "_Staged | None"]:
        """The host-resident sources and their segments staged for one `torch.cat`, kept while the engine passes the
        same chunk list (one per layout). One buffer serves every snapshot: the engine drains one before the next."""
        if self._host_plan is None or self._host_plan[0] is not chunks:
            on_host = {i for i, t in enumerate(sources) if self._on_host(t)}
            segments = [s for c in chunks for s in c.segments if s.source in on_host]
            self._host_plan = (chunks, on_host, _Staged(sources, segments) if segments else None)
        return self._host_plan[1], self._host_plan[2]

    def _device_plan(self, sources: Sequence[torch.Tensor], chunks: Sequence[Chunk], on_host: set[int],
                     slot: Slot) -> devcrc.Plan | None:
        """The device checksum's plan of this layout (the slot's gaps zeroed once); None where the host checksums."""
        if self.device_crc is None:
            return None
        if self._crc_plan is None or self._crc_plan[0] is not chunks or self._crc_plan[1] is not sources:
            self._crc_plan = (chunks, sources, self.device_crc.plan(sources, chunks, on_host))
        key = str(slot.path)
        if self._zeroed.get(key) != (slot.generation, chunks):
            devcrc.zero_gaps(slot.array, chunks)
            self._zeroed[key] = (slot.generation, chunks)
        return self._crc_plan[2]

    def warm_up(self) -> None:
        """Have the issuing thread compile the device checksum's kernel now (Triton: a second or two, the first time
        on a machine) rather than at the first snapshot, which the next step's guard would wait for."""
        if self.device_crc is not None:
            self._issuer.submit(self._warm)

    def _warm(self) -> None:
        src = torch.zeros(256, dtype=torch.uint8, device=self.device_crc.device)
        chunks = plan_chunks(layout([256], [], 0, 1).pieces, 256, 256)
        warm = self.device_crc.plan([src], chunks, set())
        if self._launch_crc(warm) is not None:  # a failure turned the device checksum off, with its event
            event = self._record()  # the plan's tensors are dropped once the kernel has run
            try:
                self._synchronize(event)
            finally:
                self._release(event)

    def _launch_crc(self, plan: devcrc.Plan) -> devcrc.Plan | None:
        """Queue the device checksum on the copy stream; on a failure (no compiler for the kernel, say) say so once
        and checksum on the host from now on."""
        try:
            with self._on_copy_stream():
                self.device_crc.launch(plan)
            return plan
        except Exception as exc:
            self.device_crc = None
            events.emit("device_checksum_off", level=logging.WARNING, error=f"{type(exc).__name__}: {exc}",
                        fallback="crc32c on the host after each chunk lands")
            return None

    def _issue(self, transfer: StreamTransfer, chunks: Sequence[Chunk], claim: SlotClaim, ready: Any,
               on_host: set[int], staged: "_Staged | None" = None) -> list[int]:
        """Take the slot (its old version withdrawn right before its bytes are overwritten), pin it, place the
        host-held bytes; after `ready`, the device checksum, then the device bytes as few, large copies (segments
        merged across chunks), an event per `event_bytes`; host checksums as each event completes."""
        crcs: list[Future | None] = [None] * len(chunks)
        inflight: deque = deque()  # (event, chunks [landed, upto) complete with it, bytes)
        landed = 0
        plan = slot = None

        def land() -> int:  # those chunks are in host memory: their bytes no longer count as in flight
            nonlocal landed
            event, upto, nbytes = inflight.popleft()
            try:
                self._synchronize(event)
            finally:
                self._release(event)
            for j in range(landed, upto) if plan is None else ():
                c = chunks[j]
                crcs[j] = self._crc.submit(crc32c, slot.array[c.offset:c.offset + c.nbytes])
            landed = upto
            return nbytes

        try:
            try:
                try:
                    slot = claim()
                    host = self._pin(slot)
                    if staged is not None:
                        staged.place(slot.array)
                    plan = self._device_plan(transfer.sources, chunks, on_host, slot)
                    self._wait_ready(ready)
                finally:
                    self._release(ready)
                plan = plan and self._launch_crc(plan)
                # with the device's checksums nothing waits for a chunk to land: all copies go at once, so that the
                # next optimizer step's guard, which waits until they are issued, does not wait for the copy itself
                self._issue_all(transfer, chunks, host, on_host, inflight, land, capped=plan is None)
            finally:
                self._record_done(transfer)
            while inflight:
                land()
        finally:  # what a failure left in flight: nothing will wait on those events
            while inflight:
                self._release(inflight.popleft()[0])
        if plan is not None:  # the device's answer landed before the last event
            return devcrc.finish(plan, slot.array)
        return [f.result() for f in crcs]

    def _issue_all(self, transfer: StreamTransfer, chunks: Sequence[Chunk], host: torch.Tensor, on_host: set[int],
                   inflight: deque, land: Callable[[], int], capped: bool = True) -> None:
        """Issue every copy, an event per `event_bytes` into `inflight`, no more than `cap` bytes in flight (`capped`)
        or all of them and one event."""
        every = max(1, min(self.event_bytes, self.cap // 4)) if capped else float("inf")
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
                while capped and pending > self.cap and len(inflight) > 1:
                    pending -= land()

    def _record_done(self, transfer: StreamTransfer) -> None:
        """The transfer's done event, recorded after whatever was issued, even after a failure; `issued` set."""
        try:
            transfer.done_event = self._record()
        except Exception:  # the device is gone; guard falls back to a host wait
            _log.debug("no done event could be recorded", exc_info=True)
        finally:
            transfer.issued.set()

    def guard(self, transfer: StreamTransfer) -> None:
        """Device-side: the compute stream waits for the copy's last event; the host only while chunks are issued."""
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
