"""Restore from memory: agree on the versions every rank holds, verify each chunk while copying it back into the live
tensors, rebuild the replicated state from the data-parallel members' shares. Which step and source a restore tries
in which order is hpcft.durable.resume's."""
import itertools
import logging
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from hpcft import events
from hpcft.errors import CheckpointError, IntegrityError, ManifestError, StoreError
from hpcft.snapshot import plan, schema
from hpcft.snapshot.groups import Group
from hpcft.snapshot.state import Entry, grains, split
from hpcft.store import RankStore, Version, chunk_crc, crc32c, ntcopy, prefetch, seal, seal_key
from hpcft.store.paths import DATA, slot_file

_log = logging.getLogger(__name__)
OK, LOST, MISMATCH = 0, 1, 2
WIDTH = 16  # steps per rank and source compared by `held_everywhere_each`, whatever each rank's `keep`


def held_everywhere_each(helds: Sequence[Sequence[Any]], world: Any = None) -> list[tuple[list[int], bool]]:
    """For each list in `helds` (anything with a `.step`: memory, durable, node-local copies), the steps complete on
    every rank, newest first, and whether any rank holds any. Collective over `world` (a CPU-capable group of every
    rank, None: the default group): one all-gather for every list."""
    mine = [sorted({v.step for v in held}, reverse=True) for held in helds]
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [(steps, bool(steps)) for steps in mine]
    row = torch.full((len(helds), WIDTH), -1, dtype=torch.int64)
    for i, steps in enumerate(mine):
        row[i, :len(steps[:WIDTH])] = torch.tensor(steps[:WIDTH], dtype=torch.int64)
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, row, group=world)
    out = []
    for i in range(len(helds)):
        sets = [set(r[i].tolist()) - {-1} for r in rows]
        out.append((sorted(set.intersection(*sets), reverse=True), any(sets)))
    return out


def agree(code: int, world: Any = None) -> int:
    """The worst of every rank's verdict (OK < LOST < MISMATCH), on every rank (collective over `world`)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return code
    t = torch.tensor([code], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=world)
    return int(t)


class _Sinks:
    """Where each live tensor's restored bytes go, made by the first worker that needs it: a contiguous CPU tensor's
    address, a device tensor's byte view, or a strided tensor's staging buffer (made up front) `finish` copies in."""

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
                view = self.entries[i].local
                if not view.is_cpu:  # a CPU tensor is its address (no view to make: a relaunch's first restore
                    view = view.reshape(-1).view(torch.uint8)  # makes hundreds, ~5 us each; nor a device object)
            sink = self._made[i] = view.data_ptr() if view.is_cpu else view
        return sink

    def finish(self) -> None:
        for i, buf in self.staging.items():
            t = self.entries[i].local
            t.copy_(buf.view(t.dtype).view(t.shape))


def _load_chunk(copy_crc: Callable[[int, int, int, int], int], data: np.ndarray, base: int, chunk: plan.Chunk,
                sinks: _Sinks) -> int:
    """Copy one chunk's segments into their sinks (a CPU sink by `copy_crc`, ntcopy.raw_copy_crc; a device one by a
    host-to-device copy) and return the crc32c of the chunk's bytes in the file, padding included."""
    def padding(lo: int, hi: int, crc: int) -> int:
        return crc32c(data[lo:hi], crc)

    def segment(s: plan.Segment, crc: int) -> int:
        sink = sinks[s.source]
        if isinstance(sink, int):
            return copy_crc(sink + s.start, base + s.offset, s.nbytes, crc)
        src = data[s.offset:s.offset + s.nbytes]
        sink[s.start:s.start + s.nbytes].copy_(torch.from_numpy(src))
        return crc32c(src, crc)

    return chunk_crc(chunk, padding, segment)


class Loader:
    """Loads one version into live entries; `threads` workers verify and copy chunks, into host tensors with `kernel`
    (ntcopy.raw_copier; hpcft.snapshot.calibration chooses both). `world` and `group.pg` carry the verdicts (CPU
    tensors); the replicated shares travel on `group.for_bytes(their device)`."""

    def __init__(self, store: RankStore, group: Group | None, threads: int = 2, world: Any = None,
                 kernel: str = "fused"):
        self.store = store
        self.group = group
        self.world = world
        self.threads = max(1, threads)
        self.copy = ntcopy.raw_copier(kernel)  # the replicated shares' scatter (checked as a whole before)
        self.copy_crc = ntcopy.raw_copy_crc(kernel)
        self._chunk_copy = ntcopy.chunk_copy(kernel)  # the whole copy in C, where it runs (into host memory)
        self._dst: tuple[plan.Grid, _Sinks, np.ndarray] | None = None  # the segments' destinations, for the last grid
        self._pool: ThreadPoolExecutor | None = None
        # kept while the live entries are the same list (one per layout): the sinks, and the grids of the manifests
        # (one dict while its file is unchanged, store.manifest.ReadCache) that passed the schema's checks against it
        self._sinks: tuple[Sequence[Entry], _Sinks] | None = None
        self._checked: list[tuple[dict[str, Any], _Sinks, plan.Grid]] = []

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def load(self, versions: Sequence[Version], entries: Sequence[Entry],
             check_meta: Callable[[dict[str, Any]], None] | None = None) -> tuple[Version, int]:
        """Load one of `versions` (this rank's copies of one step, preferred first) into `entries` on every rank
        (collective); the version loaded and the bytes read. Each manifest is checked first (`schema`, and
        `check_meta`: the caller's check of what it applies after the load). IntegrityError / CheckpointError on
        every rank if any failed (a lying manifest or unusable file counts as lost), so all fall back together."""
        own, rep = split(entries, self.group)
        sinks = self._sinks_of(entries, own, rep)
        codes, reasons, nbytes, loaded = [], [], 0, versions[0]
        for version in versions:
            code, reason, nbytes = self._local_load(version, own, rep, sinks, check_meta)
            codes.append(code)
            reasons.append(reason)
            if code == OK:
                loaded = version
                break
        worst = agree(OK if OK in codes else max(codes), self.world)
        if worst != OK:
            why = "; ".join(r for r in reasons if r) or ("another rank lost a chunk of this version" if worst == LOST
                                                         else "another rank's snapshot does not match its live state")
            raise (IntegrityError if worst == LOST else CheckpointError)(f"step {loaded.step}: {why}")
        if rep:
            self._exchange(loaded, rep, sinks, len(own))
        sinks.finish()
        return loaded, nbytes

    def _sinks_of(self, entries: Sequence[Entry], own: list[Entry], rep: list[Entry]) -> _Sinks:
        if self._sinks is None or self._sinks[0] is not entries:
            self._sinks, self._checked = (entries, _Sinks([*own, *rep])), []
        return self._sinks[1]

    def _grid(self, m: dict[str, Any], own: Sequence[Entry], rep: Sequence[Entry], sinks: _Sinks) -> plan.Grid:
        """The schema's checks of `m` against the live entries, once per manifest and layout (`sinks`)."""
        for seen, live, grid in self._checked:
            if seen is m and live is sinks:
                return grid
        schema.check_types(m)
        schema.check_structure(m, own, rep, self.group)
        grid = schema.check_layout(m, own, rep, self.group)
        self._checked = [*self._checked[-(self.store.nslots + 1):], (m, sinks, grid)]
        return grid

    def _local_load(self, version: Version, own: Sequence[Entry], rep: Sequence[Entry], sinks: _Sinks,
                    check_meta: Callable[[dict[str, Any]], None] | None) -> tuple[int, str, int]:
        """Check and load `version` on this rank alone: (OK / LOST / MISMATCH, why not, bytes read)."""
        m = version.manifest
        try:
            grid = self._grid(m, own, rep, sinks)
            if check_meta is not None:
                check_meta(m)
            return OK, "", self._local(version, grid, sinks)
        except ManifestError as exc:
            events.emit("manifest_bad", level=logging.ERROR, rank=self.store.rank, step=version.step,
                        path=str(slot_file(self.store.dir, version.slot)), error=str(exc))
            return LOST, str(exc), 0
        except StoreError as exc:  # the data file is a symlink, FIFO, directory, another user's, ...
            events.emit("store_file_refused", level=logging.ERROR, rank=self.store.rank, step=version.step,
                        path=str(slot_file(self.store.dir, version.slot, DATA)), error=str(exc))
            return LOST, str(exc), 0
        except IntegrityError as exc:
            return LOST, str(exc), 0
        except CheckpointError as exc:
            return MISMATCH, str(exc), 0

    def _local(self, version: Version, grid: plan.Grid, sinks: _Sinks) -> int:
        """Copy every chunk of this rank's data file (laid out as `grid`) into the live tensors and verify its sealed
        crc32c. The workers take chunks from one counter: in one C call each (`ntcopy.ChunkCopy`) where every
        destination is host memory, else chunk by chunk from Python."""
        recorded, step, key = version.manifest["chunks"], version.step, seal_key(version.manifest)
        size, total = grid.chunk_bytes, grid.nbytes
        slot = self.store.slot(version.slot, create=False)
        data = slot.array
        if data.size < total:
            raise IntegrityError(f"data file of rank {self.store.rank} holds {data.size} bytes, its manifest {total}")
        base = ntcopy.address(data)
        if not slot.populated:  # mapped here, not ahead: its pages in bulk first, by every worker (prefetch.Pieces)
            pieces = prefetch.Pieces(base, data.size)
            self._run(lambda: pieces.work() or [])
            slot.populated = not pieces.failed
        dst = self._destinations(grid, sinks)
        if dst is not None:
            load = self._chunk_copy(base, dst, *grid.table()[2:], key)
            self._run(lambda: load.run() or [])
            lost = [i for i, (got, r) in enumerate(zip(load.crcs.tolist(), recorded)) if got != r[2]]
        else:
            take = itertools.count().__next__  # atomic under the GIL: each chunk goes to exactly one worker
            lost = self._run(lambda: self._chunks(grid, sinks, data, base, key, recorded, take))
        if lost:
            events.emit("chunk_lost", level=logging.ERROR, rank=self.store.rank, step=step,
                        chunks=len(lost), first_offset=lost[0] * size, path=str(self.store.dir))
            raise IntegrityError(f"{len(lost)} chunk(s) of rank {self.store.rank}'s data fail their crc32c")
        return total

    def _run(self, work: Callable[[], list[int]]) -> list[int]:
        """`work()` on this thread and `threads - 1` pool threads at once; the chunks they found lost, in order."""
        if self._pool is None and self.threads > 1:
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="hpcft-restore")
        futures = [self._pool.submit(work) for _ in range(self.threads - 1)]
        try:
            lost = work()
        finally:
            wait(futures)
        return sorted(lost + [i for f in futures for i in f.result()])

    def _chunks(self, grid: plan.Grid, sinks: _Sinks, data: np.ndarray, base: int, key: int, recorded: list,
                take: Callable[[], int]) -> list[int]:
        """One worker's chunks, copied segment by segment from Python (device or strided sinks, no C loop here)."""
        lost = []
        while (i := take()) < grid.count:
            if seal(_load_chunk(self.copy_crc, data, base, grid.chunk(i), sinks), key) != recorded[i][2]:
                lost.append(i)
        return lost

    def _destinations(self, grid: plan.Grid, sinks: _Sinks) -> np.ndarray | None:
        """Each segment's destination address where every sink is in host memory, else None (kept per grid)."""
        if self._chunk_copy is None:
            return None
        if self._dst is not None and self._dst[0] is grid and self._dst[1] is sinks:
            return self._dst[2]
        table = grid.table()
        used = np.unique(table.source).tolist()
        where = [sinks[i] for i in used]
        if not all(isinstance(w, int) for w in where):
            return None
        addresses = np.zeros(len(sinks.entries), dtype=np.uint64)
        addresses[used] = where
        dst = addresses[table.source.astype(np.intp)] + table.start
        self._dst = (grid, sinks, dst)
        return dst

    def _exchange(self, version: Version, rep: Sequence[Entry], sinks: _Sinks, first: int) -> None:
        """Each member broadcasts its verified share; the others scatter it into their replicas (sinks `first`, ...).
        Shares travel on the user's group where it carries the replicas' device, else through hpcft's CPU group."""
        sizes = [e.nbytes for e in rep]
        cuts = plan.rep_cuts(sizes, self.group.size, grains(rep))
        offset = version.manifest["share"]["offset"]
        data = self.store.slot(version.slot, create=False).array
        device = next((e.local.device for e in rep if e.local.device.type != "cpu"), torch.device("cpu"))
        pg, where = self.group.for_bytes(device)
        scratch = torch.empty(max(b - a for a, b in zip(cuts, cuts[1:])), dtype=torch.uint8, device=where)
        copy = self.copy
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
