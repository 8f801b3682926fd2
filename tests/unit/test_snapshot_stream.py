"""The device backends' shared issuing logic (cap on bytes in flight, per-chunk checksums, failure
ordering), driven on the CPU by a backend whose 'device' primitives are host copies and host events."""
import threading

import pytest
import torch

from hpcft.snapshot import plan
from hpcft.snapshot.copiers.base import crc_chunks
from hpcft.snapshot.copiers.base import SlotClaim
from hpcft.snapshot.copiers.stream import StreamCopier


class HostStream(StreamCopier):
    """Copies happen at `_record` time (a batch per event), so bytes 'in flight' are real until synchronized."""

    name = "host-stream"

    def __init__(self, cap: int, fail_at: int | None = None, host_resident=(), device_busy=None):
        super().__init__(cap)
        self.batch, self.inflight, self.peak, self.fail_at, self.copies = [], 0, 0, fail_at, 0
        self.compute_waited = []
        self.host_resident = {t.data_ptr() for t in host_resident}  # the rest plays device memory
        self.device_busy = device_busy  # an Event: the 'device' starts copying once it is set

    def _on_host(self, t):
        return t.data_ptr() in self.host_resident

    def _register(self, ptr, size): pass
    def _unregister(self, ptr): pass
    def _record_ready(self): return "ready"
    def _wait_ready(self, ready):
        assert ready == "ready"
        if self.device_busy is not None:
            self.device_busy.wait()

    def _copy(self, host, offset, src, start, nbytes):
        self.copies += 1
        if self.fail_at is not None and self.copies > self.fail_at:
            raise RuntimeError("device lost")
        self.batch.append((host, offset, src, start, nbytes))
        self.inflight += nbytes
        self.peak = max(self.peak, self.inflight)

    def _record(self):
        done, batch, self.batch = threading.Event(), self.batch, []
        return (done, batch)

    def _synchronize(self, event):
        done, batch = event
        for host, offset, src, start, nbytes in batch:
            host[offset:offset + nbytes].copy_(src[start:start + nbytes])
            self.inflight -= nbytes
        done.set()

    def _compute_waits(self, event):
        self.compute_waited.append(event)


def _work(n_tensors: int = 12, size: int = 5000):
    sources = [torch.randint(0, 255, (size,), dtype=torch.uint8) for _ in range(n_tensors)]
    lay = plan.layout([size] * n_tensors, [], 0, 1)
    return sources, lay, plan.chunks(lay.pieces, lay.nbytes, 4096)


def test_cap_checksums_and_guard(slot) -> None:
    sources, lay, chunks = _work()
    copier = HostStream(cap=3 * 4096)
    transfer = copier.start(sources, chunks, SlotClaim(lambda: slot))
    copier.guard(transfer)
    crcs = transfer.result()
    assert copier.peak <= 3 * 4096 + 4096  # never more than the cap plus the chunk being issued
    assert crcs == crc_chunks(slot.array, chunks)
    for i, p in enumerate(lay.pieces):
        assert bytes(slot.array[p.offset:p.offset + p.nbytes]) == sources[i].numpy().tobytes()
    assert len(copier.compute_waited) == 1
    copier.close()


def test_failure_mid_issue_still_orders_the_next_step(slot) -> None:
    sources, _, chunks = _work()
    copier = HostStream(cap=1 << 30, fail_at=5)
    transfer = copier.start(sources, chunks, SlotClaim(lambda: slot))
    copier.guard(transfer)  # the copies issued before the failure are still waited for
    assert len(copier.compute_waited) == 1
    with pytest.raises(RuntimeError, match="device lost"):
        transfer.result()
    copier.close()


def test_guard_without_event_raises(slot) -> None:
    class NoEvents(HostStream):
        def _record(self):
            raise RuntimeError("no events")

    sources, _, chunks = _work()
    copier = NoEvents(cap=1 << 30)
    transfer = copier.start(sources, chunks, SlotClaim(lambda: slot))
    with pytest.raises(RuntimeError, match="no events"):
        copier.guard(transfer)
    copier.close()


def test_host_resident_state_is_copied_at_start(slot) -> None:
    """AdamW keeps the step counters of GPU parameters on the CPU, where no device event orders the next
    optimizer step's update after the copy: bytes the host updates are copied in `start`, so the snapshot
    holds their value at its step however late the device copies are issued. The device bytes go as one
    copy per tensor, its segments merged across chunks."""
    sources, lay, chunks = _work()
    counter = sources[3]
    at_step = counter.clone()
    busy = threading.Event()
    copier = HostStream(cap=1 << 20, host_resident=[counter], device_busy=busy)
    transfer = copier.start(sources, chunks, SlotClaim(lambda: slot))
    counter.add_(1)  # the next optimizer step, on the host, while the device is still busy
    busy.set()
    copier.guard(transfer)
    crcs = transfer.result()
    p = lay.pieces[3]
    assert bytes(slot.array[p.offset:p.offset + p.nbytes]) == at_step.numpy().tobytes()
    assert crcs == crc_chunks(slot.array, chunks)
    assert copier.copies == len(sources) - 1
    copier.close()


def test_the_issuing_thread_takes_the_slot_and_a_snapshot_without_one_is_skipped(shm_root, monkeypatch) -> None:
    """On a GPU the slot is taken (its old version withdrawn: pin reads, unlinks) by the issuing thread, right before
    it writes, not by the training thread at the boundary; when none can be taken the snapshot is skipped with
    `snapshot_skipped`, the next step's guard still returns, and the next snapshot is taken."""
    from hpcft import events
    from hpcft.errors import StoreError
    from hpcft.snapshot.engine import SnapshotEngine
    from hpcft.snapshot.state import Entry
    from hpcft.store import RankStore

    seen = []
    monkeypatch.setattr(events, "emit", lambda kind, **f: seen.append(kind))
    store = RankStore("j", 0, root=shm_root)
    takers, refuse = [], [False]
    begin = store.begin

    def taking(nbytes):
        takers.append(threading.current_thread().name)
        if refuse[0]:
            raise StoreError("every reusable slot is pinned")
        return begin(nbytes)

    store.begin = taking
    engine = SnapshotEngine(store, HostStream(cap=1 << 20), chunk_bytes=512)
    entries = [Entry("model/w", torch.randn(300), False)]
    for step in (1, 2, 3):
        refuse[0] = step == 2
        assert engine.snapshot(step, entries, {})
        engine.guard()
        engine.wait()
    assert all(name.startswith("hpcft-issue") for name in takers) and len(takers) == 3
    assert [v.step for v in store.versions()] == [1, 3]
    assert seen.count("snapshot_skipped") == 1 and engine.stats.skipped == 1 and engine.stats.snapshots == 2
    engine.close()
