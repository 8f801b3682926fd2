"""Restore (the paper's distributed in-memory loading): agree on the newest version every rank holds,
verify each chunk while copying it back into the live tensors, and rebuild the replicated state from
the data-parallel members' shares through the process group."""
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from hpcft import events
from hpcft.errors import CheckpointError, IntegrityError
from hpcft.snapshot import ntcopy, plan
from hpcft.snapshot.engine import signature
from hpcft.snapshot.groups import Group
from hpcft.snapshot.state import Entry
from hpcft.store import RankStore, Version, crc32c

_log = logging.getLogger(__name__)
OK, LOST, MISMATCH = 0, 1, 2


def held_everywhere(store: RankStore, held: Sequence[Version], world: Any = None) -> tuple[list[int], bool]:
    """Steps complete on every rank (each holding `held`), newest first, and whether any rank holds any
    (`world`: a group of every rank that carries CPU tensors, None for the default group)."""
    mine = sorted({v.step for v in held}, reverse=True)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine, bool(mine)
    width = store.nslots
    row = torch.full((width,), -1, dtype=torch.int64)
    row[:len(mine[:width])] = torch.tensor(mine[:width], dtype=torch.int64)
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, row, group=world)
    sets = [set(r.tolist()) - {-1} for r in rows]
    return sorted(set.intersection(*sets), reverse=True), any(sets)


class _Sinks:
    """Where each live tensor's restored bytes go, made by whichever worker first needs it: the address of a
    contiguous CPU tensor's bytes, a device tensor's byte view, or, for a strided tensor, a staging buffer
    (made up front, since every chunk that writes the tensor must write the same one) that `finish` copies in."""

    def __init__(self, entries: Sequence[Entry]):
        self.entries = entries
        self.staging = {i: torch.empty(e.nbytes, dtype=torch.uint8, device=e.local.device)
                        for i, e in enumerate(entries) if not e.local.is_contiguous()}
        self._made: list[int | torch.Tensor | None] = [None] * len(entries)

    def __getitem__(self, i: int) -> int | torch.Tensor:
        sink = self._made[i]
        if sink is None:  # two workers may both make it: equal views of the same bytes
            view = self.staging.get(i)
            if view is None:
                view = self.entries[i].local.reshape(-1).view(torch.uint8)
            sink = self._made[i] = view.data_ptr() if view.device.type == "cpu" else view
        return sink

    def finish(self) -> None:
        for i, buf in self.staging.items():
            t = self.entries[i].local
            t.copy_(buf.view(t.dtype).view(t.shape))


def _put(copy: Callable[[int, int, int], None], sink: int | torch.Tensor, start: int, src: np.ndarray,
         offset: int, nbytes: int, base: int) -> None:
    """sink[start:start+nbytes] = src[offset:offset+nbytes] (`base`: the address of src): `copy` (streaming
    stores, see ntcopy) into a CPU sink, which nothing reads back soon; a host-to-device copy into a device one."""
    if isinstance(sink, int):
        copy(sink + start, base + offset, nbytes)
    else:
        sink[start:start + nbytes].copy_(torch.from_numpy(src[offset:offset + nbytes]))


def _load_chunk(copy: Callable[[int, int, int], None], data: np.ndarray, base: int, chunk: plan.Chunk,
                sinks: _Sinks) -> int:
    """Copy one chunk's segments into their sinks and return the crc32c of the chunk's bytes in the file
    (padding included), read right after the copy read them, so from cache: a chunk costs one read from
    memory and one write."""
    for s in chunk.segments:
        _put(copy, sinks[s.source], s.start, data, s.offset, s.nbytes, base)
    return crc32c(data[chunk.offset:chunk.offset + chunk.nbytes])


def _check_structure(m: dict[str, Any], own: Sequence[Entry], rep: Sequence[Entry], group: Group | None) -> None:
    saved = [(e["name"], e["dtype"], e["shape"], e.get("placement")) for e in m["entries"]]
    live = [(e.name, d["dtype"], d["shape"], d.get("placement")) for e, d in ((e, e.describe()) for e in own)]
    if saved != live:
        diff = sorted(set(map(str, saved)) ^ set(map(str, live)))[:3]
        raise CheckpointError(f"snapshot of step {m['step']} does not match the live model/optimizer "
                              f"(first differences: {diff}); restore into the same model, layout and optimizer")
    share = m.get("share")
    if bool(share) != bool(rep) or (share and (share["members"] != group.size or share["member"] != group.member
                                              or share["signature"] != signature(rep))):
        raise CheckpointError(f"snapshot of step {m['step']} was split over a different data-parallel group "
                              "(or different replicated state) than the live one")


class Loader:
    """Loads one version into live entries; `threads` workers verify and copy chunks. `world` and `group.pg`
    carry the verdicts (CPU tensors); the replicated shares travel on `group.for_bytes(their device)`."""

    def __init__(self, store: RankStore, group: Group | None, threads: int = 2, world: Any = None):
        self.store = store
        self.group = group
        self.world = world
        self.threads = max(1, threads)
        self._pool: ThreadPoolExecutor | None = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def split(self, entries: Sequence[Entry]) -> tuple[list[Entry], list[Entry]]:
        on = self.group is not None and self.group.size > 1
        return [e for e in entries if not (on and e.replicated)], [e for e in entries if on and e.replicated]

    def load(self, version: Version, entries: Sequence[Entry]) -> int:
        """Load `version` into `entries` on every rank (collective). Returns bytes read from the local store.
        IntegrityError / CheckpointError on every rank if any rank failed, so all fall back together."""
        own, rep = self.split(entries)
        m = version.manifest
        code, reason, nbytes = OK, "", 0
        sinks = _Sinks([*own, *rep])
        try:
            _check_structure(m, own, rep, self.group)
            nbytes = self._local(version, own, rep, sinks)
        except IntegrityError as exc:
            code, reason = LOST, str(exc)
        except CheckpointError as exc:
            code, reason = MISMATCH, str(exc)
        worst = self._agree(code)
        if worst != OK:
            why = reason or ("another rank lost a chunk of this version" if worst == LOST
                             else "another rank's snapshot does not match its live state")
            raise (IntegrityError if worst == LOST else CheckpointError)(f"step {version.step}: {why}")
        if rep:
            self._exchange(version, rep, sinks, len(own))
        sinks.finish()
        return nbytes

    def _agree(self, code: int) -> int:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return code
        t = torch.tensor([code], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.world)
        return int(t)

    def _local(self, version: Version, own: Sequence[Entry], rep: Sequence[Entry], sinks: _Sinks) -> int:
        """Copy every chunk of this rank's data file into the live tensors and verify its crc32c. The workers
        (this thread and `threads - 1` pool threads) take chunks from one counter and plan each as they take
        it: no plan is built before the copy starts, and a worker slowed by other load takes fewer chunks."""
        m = version.manifest
        pieces = [plan.Piece(i, 0, e.nbytes, d["offset"]) for i, (e, d) in enumerate(zip(own, m["entries"]))]
        if rep:
            lo, hi = m["share"]["range"]
            pieces += [plan.Piece(p.source + len(own), p.start, p.stop, p.offset) for p in
                       plan.pieces_of_range([e.nbytes for e in rep], lo, hi, m["share"]["offset"])]
        grid = plan.Grid(pieces, m["data_bytes"], m["chunk_bytes"])
        recorded = m["chunks"]
        size, total = grid.chunk_bytes, grid.nbytes
        if len(recorded) != grid.count or any(r[0] != i * size or r[1] != min(size, total - i * size)
                                              for i, r in enumerate(recorded)):
            raise CheckpointError(f"step {version.step}: the manifest's chunk table does not match its layout")
        data = self.store.slot(version.slot).array
        if data.size < total:
            raise IntegrityError(f"step {version.step}: data file is shorter than its manifest says")
        take = itertools.count().__next__  # atomic under the GIL: each chunk goes to exactly one worker
        copy, base = ntcopy.raw_copier(), ntcopy.address(data)

        def work() -> list[int]:
            lost = []
            while (i := take()) < grid.count:
                if _load_chunk(copy, data, base, grid.chunk(i), sinks) != recorded[i][2]:
                    lost.append(i)
            return lost

        if self._pool is None and self.threads > 1:
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="hpcft-restore")
        futures = [self._pool.submit(work) for _ in range(self.threads - 1)]
        try:
            lost = work()
        finally:
            wait(futures)
        lost = sorted(lost + [i for f in futures for i in f.result()])
        if lost:
            events.emit("chunk_lost", level=logging.ERROR, rank=self.store.rank, step=version.step,
                        chunks=len(lost), first_offset=lost[0] * size, path=str(self.store.dir))
            raise IntegrityError(f"{len(lost)} chunk(s) of rank {self.store.rank}'s data fail their crc32c")
        return total

    def _exchange(self, version: Version, rep: Sequence[Entry], sinks: _Sinks, first: int) -> None:
        """Each member broadcasts its verified share; the others scatter it into their replicas (the
        replicated entries are sinks `first`, `first + 1`, ...). The shares travel on the user's group, staged on
        the device, where that group carries the replicas' device; else through the host on hpcft's CPU group."""
        sizes = [e.nbytes for e in rep]
        cuts = plan.share_cuts(sum(sizes), self.group.size)
        offset = version.manifest["share"]["offset"]
        data = self.store.slot(version.slot).array
        device = next((e.local.device for e in rep if e.local.device.type != "cpu"), torch.device("cpu"))
        pg, where = self.group.for_bytes(device)
        scratch = torch.empty(max(b - a for a, b in zip(cuts, cuts[1:])), dtype=torch.uint8, device=where)
        copy = ntcopy.raw_copier()
        for j, src in enumerate(self.group.ranks):
            lo, hi = cuts[j], cuts[j + 1]
            if hi == lo:
                continue
            if j == self.group.member:
                mine = torch.from_numpy(data[offset:offset + hi - lo])
                buf = mine if where.type == "cpu" else scratch[:hi - lo].copy_(mine)
            else:
                buf = scratch[:hi - lo]
            dist.broadcast(buf, src=src, group=pg)
            if j != self.group.member:
                _scatter(copy, buf, plan.pieces_of_range(sizes, lo, hi, 0), sinks, first)


def _scatter(copy: Callable[[int, int, int], None], buf: torch.Tensor, pieces: Sequence[plan.Piece], sinks: _Sinks,
             first: int) -> None:
    """Copy the pieces of a received share `buf` (on the host or the device) into their sinks `first + source`."""
    host: np.ndarray | None = buf.numpy() if buf.device.type == "cpu" else None
    for p in pieces:
        sink = sinks[first + p.source]
        if isinstance(sink, torch.Tensor):
            sink[p.start:p.start + p.nbytes].copy_(buf[p.offset:p.offset + p.nbytes])
            continue
        if host is None:
            host = buf.cpu().numpy()
        copy(sink + p.start, ntcopy.address(host) + p.offset, p.nbytes)


def restore_newest(loader: Loader, entries_fn) -> Version | None:
    """Load the newest version complete on every rank, falling back on loss; None on a fresh run.
    `entries_fn()` returns the live entries (called once, after the caller created optimizer state)."""
    store = loader.store
    t0 = time.perf_counter()
    held = store.versions()
    candidates, anything = held_everywhere(store, held, loader.world)
    if not candidates:
        if anything:
            events.emit("restore_none", level=logging.WARNING, rank=store.rank,
                        reason="no version is complete on every rank; starting from step 0")
        return None
    entries = entries_fn()
    by_step = {v.step: v for v in held}
    failures = []
    for step in candidates:
        try:
            nbytes = loader.load(by_step[step], entries)
        except CheckpointError as exc:
            failures.append(str(exc))
            events.emit("restore_fallback", level=logging.ERROR, rank=store.rank, step=step, error=str(exc))
            continue
        events.emit("restore_done", rank=store.rank, step=step, bytes=nbytes,
                    seconds=round(time.perf_counter() - t0, 6), skipped=len(failures))
        return by_step[step]
    raise IntegrityError("restore failed: no version held by every rank could be loaded: " + "; ".join(failures))
