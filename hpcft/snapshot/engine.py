"""The asynchronous snapshot engine: (a) chunked copies into a store slot by a copier backend, (b) the replicated
state split across the data-parallel group; a thread commits the manifest once the copy landed. Level (c)
(protection, persistence) is the node agent's."""
import collections
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from hpcft import events
from hpcft.errors import CheckpointError
from hpcft.snapshot import plan
from hpcft.snapshot.copiers import Copier, Transfer
from hpcft.snapshot.copiers.base import SlotClaim, SlotUnavailable
from hpcft.snapshot.groups import Group
from hpcft.snapshot.state import Entry, lay_out, split
from hpcft.store import RankStore, crc32c, seal, seal_key

_log = logging.getLogger(__name__)


@dataclass
class Stats:
    """Counters for benches and status: totals since start, and the latest snapshot's figures."""
    snapshots: int = 0           # committed
    failed: int = 0              # started but not committed (copy or commit error)
    skipped: int = 0             # not started (no slot: ENOSPC, ...)
    bytes: int = 0               # bytes copied into the store by this rank, committed snapshots
    blocked_s: float = 0.0       # training thread blocked: snapshot start + pre-step wait
    start_s: float = 0.0         # the snapshot-start part of blocked_s (RNG capture, state walk, manifest, copy issue)
    inline_copy_s: float = 0.0   # the part of blocked_s a copier spent copying on the training thread (CPU, no overlap)
    copy_s: float = 0.0          # copy + checksum wall time (off the training thread where possible)
    last_step: int = -1
    last_blocked_s: float = 0.0
    last_copy_s: float = 0.0
    last_bytes: int = 0
    history: collections.deque = field(default_factory=lambda: collections.deque(maxlen=1024))

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "history": list(self.history)}


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's bytes (a contiguous copy if it is strided: see `Prepared.stage`)."""
    t = t if t.is_contiguous() else t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def source(e: Entry) -> torch.Tensor:
    """What a snapshot copies for `e`: its bytes in place, or a contiguous copy of its own (refreshed at every
    snapshot by `Prepared.stage`) for a strided tensor and for one that changes outside the optimizer's step."""
    if e.boundary and e.local.is_contiguous() and e.nbytes:
        return e.local.clone().reshape(-1).view(torch.uint8)
    return byte_view(e.local)


def signature(entries: Sequence[Entry]) -> int:
    """crc32c of the names, dtypes and shapes: equal on every member iff their layouts agree."""
    text = "|".join(f"{e.name}:{e.local.dtype}:{tuple(e.local.shape)}" for e in entries)
    return crc32c(text.encode())


@dataclass
class Prepared:
    """A layout with its byte views and chunks, reused while the state's tensors stay the same."""
    key: tuple
    own: list[Entry]
    rep: list[Entry]
    layout: plan.Layout
    sources: list[torch.Tensor]
    chunks: list[plan.Chunk]
    rep_signature: int
    described: dict[str, Any] | None = None
    entries: Sequence[Entry] | None = None  # the list it was prepared from
    staged: tuple[list[torch.Tensor], list[torch.Tensor]] = field(init=False)  # (copies, live): what `stage` refreshes

    def __post_init__(self) -> None:
        pairs = [(src.view(e.local.dtype).view(e.local.shape), e.local)
                 for e, src in zip(self.own + self.rep, self.sources)
                 if e.nbytes and src.data_ptr() != e.local.data_ptr()]
        self.staged = ([c for c, _ in pairs], [live for _, live in pairs])

    def stage(self) -> None:
        """Refresh the copies standing in for strided tensors and buffers (`source`, cached across snapshots), in one
        call; on a GPU queued before the snapshot's ready event, so the next forward pass comes after it."""
        if self.staged[0]:
            torch._foreach_copy_(*self.staged)


class SnapshotEngine:
    """Takes snapshots of a list of entries into a RankStore through a Copier."""

    def __init__(self, store: RankStore, copier: Copier, *, group: Group | None = None,
                 chunk_bytes: int = 4 << 20):
        self.store = store
        self.copier = copier
        self.group = group
        self.chunk_bytes = chunk_bytes
        self.stats = Stats()
        self._committer = ThreadPoolExecutor(1, thread_name_prefix="hpcft-commit")
        self._prepared: Prepared | None = None
        self._checked_signature: int | None = None
        self._transfer: Transfer | None = None
        self._pending: Future | None = None
        self._prealloc: Future | None = None
        self._allocated = 0  # slot size every slot has been pre-faulted to

    # level (b): who copies what ------------------------------------------------------------------------
    def prepare(self, entries: Sequence[Entry]) -> Prepared:
        """Split entries into own and replicated, lay out this member's bytes, cut chunks (cached: the same list
        is the same layout, see snapshot.view; another list is compared entry by entry)."""
        if self._prepared is not None and self._prepared.entries is entries:
            return self._prepared
        # the geometry too: a tensor reshaped or transposed in place keeps its pointer, size and dtype
        key = tuple((e.name, e.local.data_ptr(), tuple(e.local.shape), e.local.stride(), e.local.dtype, e.replicated)
                    for e in entries)
        if self._prepared is not None and self._prepared.key == key:
            self._prepared.entries = entries
            return self._prepared
        own, rep = split(entries, self.group)
        lay = lay_out(own, rep, self.group)
        sources = [source(e) for e in own + rep]
        sig = signature(rep)
        if rep and sig != self._checked_signature:
            self._check_group_agrees(sig)
        self._prepared = Prepared(key, own, rep, lay, sources, plan.chunks(lay.pieces, lay.nbytes, self.chunk_bytes),
                                  sig, entries=entries)
        return self._prepared

    def _check_group_agrees(self, sig: int) -> None:
        """Every member must split the same replicated list, or shares would not fit together."""
        mine = torch.tensor([sig], dtype=torch.int64)
        got = [torch.zeros_like(mine) for _ in range(self.group.size)]
        dist.all_gather(got, mine, group=self.group.pg)
        if any(int(g) != sig for g in got):
            raise CheckpointError(
                "the data-parallel group's members hold different replicated state (names, dtypes or shapes "
                "differ); pass dp_group= only for ranks that hold identical replicas")
        self._checked_signature = sig

    # level (a): start, guard, commit -------------------------------------------------------------------
    def snapshot(self, step: int, entries: Sequence[Entry], meta: dict[str, Any], started: float | None = None,
                 late: Callable[[], dict[str, Any]] | None = None) -> bool:
        """Start a snapshot of `entries` as version `step` (training thread, right after the optimizer step); False,
        with an event, if it could not start. `started`: when the caller began gathering (perf_counter); `late()`
        adds to the manifest on the commit thread what is slow to encode."""
        t0 = time.perf_counter() if started is None else started
        self.wait()
        prep = self.prepare(entries)
        prep.stage()
        manifest = self._manifest(step, prep, meta)
        nbytes = prep.layout.nbytes
        claim = SlotClaim(lambda: self.store.begin(nbytes))  # taken by the copier, right before it writes
        t_copy = time.perf_counter()
        try:
            self._transfer = self.copier.start(prep.sources, prep.chunks, claim)
        except Exception as exc:  # no slot, or e.g. pinning refused: no snapshot this step, training goes on
            self._not_taken(step, exc)
            self._count_start(t0)
            return False
        inline = 0.0 if self.copier.overlap else time.perf_counter() - t_copy
        self._pending = self._committer.submit(self._commit, self._transfer, claim, manifest, prep, t_copy, late)
        if prep.layout.nbytes > self._allocated:  # the other slots, off the training thread, once
            self._allocated = prep.layout.nbytes
            self._prealloc = self._committer.submit(self.store.preallocate, prep.layout.nbytes)
        self.stats.last_blocked_s = self._count_start(t0, inline)
        return True

    def _not_taken(self, step: int, exc: Exception) -> None:
        """Count and report a snapshot that did not happen: skipped (no slot) or failed (anything else)."""
        if isinstance(exc, SlotUnavailable):
            self.stats.skipped += 1
            events.emit("snapshot_skipped", level=logging.ERROR, rank=self.store.rank, step=step, error=str(exc))
        else:
            self.stats.failed += 1
            events.emit("snapshot_failed", level=logging.ERROR, rank=self.store.rank, step=step,
                        error=f"{type(exc).__name__}: {exc}")

    def _count_start(self, t0: float, inline_copy: float = 0.0) -> float:
        blocked = time.perf_counter() - t0
        self.stats.blocked_s += blocked
        self.stats.start_s += blocked - inline_copy
        self.stats.inline_copy_s += inline_copy
        return blocked

    def guard(self) -> None:
        """Before the next optimizer step: that step must not change the state until the copy has read it."""
        if self._transfer is None:
            return
        t0 = time.perf_counter()
        try:
            self.copier.guard(self._transfer)
        except Exception:  # the commit thread reports the failure as an event
            _log.debug("snapshot copy failed; reported by the commit thread", exc_info=True)
        finally:
            self._transfer = None
            waited = time.perf_counter() - t0
            self.stats.blocked_s += waited
            self.stats.last_blocked_s += waited

    def _manifest(self, step: int, prep: Prepared, meta: dict[str, Any]) -> dict[str, Any]:
        if prep.described is None:  # the layout's part of the manifest, built once per layout
            offsets = {p.source: p.offset for p in prep.layout.pieces if p.source < len(prep.own)}
            prep.described = {"data_bytes": prep.layout.nbytes, "chunk_bytes": self.chunk_bytes,
                              "entries": [{**e.describe(), "offset": offsets[i]} for i, e in enumerate(prep.own)]}
            if prep.rep:
                prep.described["share"] = {
                    "group": list(self.group.ranks), "member": self.group.member, "members": self.group.size,
                    "range": list(prep.layout.share_range), "offset": prep.layout.share_offset,
                    "signature": prep.rep_signature, "replicated": [e.describe() for e in prep.rep]}
        return {"step": step, "rank": self.store.rank, "time": time.time(), "backend": self.copier.name,
                **prep.described, **meta}

    def _commit(self, transfer: Transfer, claim: SlotClaim, manifest: dict[str, Any], prep: Prepared, t0: float,
                late: Callable[[], dict[str, Any]] | None = None) -> None:
        step = manifest["step"]
        try:
            if late is not None:
                manifest.update(late())
            crcs = transfer.result()
            copy_s = time.perf_counter() - t0
            key = seal_key(manifest)
            manifest["chunks"] = [[c.offset, c.nbytes, seal(crc, key)] for c, crc in zip(prep.chunks, crcs)]
            self.store.commit(claim(), manifest)
        except Exception as exc:
            self._not_taken(step, exc)
            return
        s = self.stats
        s.snapshots += 1
        s.bytes += prep.layout.nbytes
        s.copy_s += copy_s
        s.last_step, s.last_copy_s, s.last_bytes = step, copy_s, prep.layout.nbytes
        s.history.append({"step": step, "bytes": prep.layout.nbytes, "copy_s": copy_s,
                          "blocked_s": s.last_blocked_s})

    def wait(self) -> None:
        """Block until the last snapshot is committed (or has failed, with its event): normally long done."""
        self.guard()
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        if self._prealloc is not None:
            self._prealloc.result()
            self._prealloc = None

    def close(self) -> None:
        """Finish the last snapshot, stop the threads, unmap the store (its snapshots stay)."""
        try:
            self.wait()
        finally:
            self._committer.shutdown(wait=True)
            self.copier.close()
            self.store.close()
