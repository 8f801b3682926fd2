"""Where a restore comes from: the newest step complete on every rank, in memory (the agents rebuilt what a replaced
node lost), in the durable tier's node-local first level (hpcft.durable.local) or on the shared file system; at an
equal step in that order; on a failure the next older candidate, every rank together. The choice and why is event
`restore_source`; a restart from step 0 although progress existed is an error-level `restore_none`."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from hpcft import events
from hpcft.durable import catalog, local, reader
from hpcft.errors import CheckpointError, IntegrityError
from hpcft.snapshot.restore import Loader, held_everywhere_each
from hpcft.snapshot.state import Entry
from hpcft.store import Version, crc32c, prefetch
from hpcft.store.owner import Owner, refuse

MEMORY, NVME, DURABLE = "memory", "nvme", "durable"
_PREFER = {MEMORY: 0, NVME: 1, DURABLE: 2}


@dataclass(frozen=True)
class Restored:
    """What a restore loaded: the step, from where, and the meta to apply (a manifest's or a durable sidecar's)."""
    step: int
    source: str
    meta: dict[str, Any]


def order(memory: Sequence[int], durable: Sequence[int], nvme: Sequence[int] = ()) -> list[tuple[int, str]]:
    """The candidates to try, newest step first; at an equal step memory, then node-local, then shared (pure)."""
    return sorted([(s, MEMORY) for s in memory] + [(s, NVME) for s in nvme] + [(s, DURABLE) for s in durable],
                  key=lambda c: (-c[0], _PREFER[c[1]]))


def why(first: tuple[int, str], memory: Sequence[int], durable: Sequence[int], failures: Sequence[str],
        nvme: Sequence[int] | None = None) -> str:
    """The reason `restore_source` gives for loading `first` (pure); `nvme`: the steps every node holds a usable
    node-local copy of (None: no node-local level here)."""
    step, source = first
    if failures:
        return "fell back: " + "; ".join(failures)
    if source == MEMORY:
        newer = f" (durable newest {durable[0]})" if durable else " (no durable checkpoint complete everywhere)"
        return f"newest step complete in every rank's memory{newer}"
    mem = f"memory's best is {memory[0]}" if memory else "memory holds no step complete on every rank"
    if source == NVME:
        return f"{mem}; every node holds its node-local copy of step {step}" + \
            ("" if step in durable else " (not on the shared file system)")
    mem = f"the durable step is newer than memory's best {memory[0]}" if memory else mem
    if nvme is None:
        return mem
    return f"{mem}; the node-local level holds no usable copy of step {step} on every node" + \
        (f" (their newest: {nvme[0]})" if nvme else "")


def restore(loader: Loader, entries_fn: Callable[[], list[Entry]], persist: Path | None,
            check_meta: Callable[[dict[str, Any]], None] | None = None, world_size: int = 1,
            local_root: Path | None = None, owner: Owner | None = None) -> Restored | None:
    """Load the newest step complete on every rank from memory, this node's first level `local_root` or `persist`
    (collective); None on a fresh run. `entries_fn()` gives the live entries (called once); `check_meta` checks what
    the caller will apply. After a load, this rank's memory versions newer than the step (or a second copy of it) are
    withdrawn (event `version_withdrawn`); those not `owner`'s to take are refused, left in place
    (hpcft.store.owner). IntegrityError if candidates existed but none could be loaded."""
    try:
        return _restore(loader, entries_fn, persist, check_meta, world_size, local_root, owner)
    finally:
        prefetch.release()  # what hpcft.init mapped ahead and the load did not adopt


def _restore(loader: Loader, entries_fn: Callable[[], list[Entry]], persist: Path | None,
             check_meta: Callable[[dict[str, Any]], None] | None, world_size: int,
             local_root: Path | None, owner: Owner | None) -> Restored | None:
    """`restore`, the mapped-ahead slots aside."""
    store = loader.store
    t0 = time.perf_counter()
    held = store.versions()
    if owner is not None:
        refused = refuse(((v.step, v.manifest) for v in held), owner, rank=store.rank, path=str(store.dir))
        held = [v for v in held if v.step not in refused]
    durables = {d.step: d for d in catalog.checkpoints(persist)}
    mine = local.usable(local_root, persist, store.rank, world_size, durables)
    (memory, in_memory), (durable, on_disk), (nvme, on_nvme) = held_everywhere_each(
        [held, list(durables.values()), list(mine.values())], loader.world)
    candidates = order(memory, durable, nvme)
    if not candidates:
        _none(store.rank, in_memory, on_disk or on_nvme, persist)
        return None
    entries = entries_fn()
    failures: list[str] = []
    for step, source in candidates:
        try:
            if source == MEMORY:
                copies = [v for v in reversed(held) if v.step == step]  # the later written first
                chosen, nbytes = loader.load(copies, entries, check_meta)
                meta = chosen.manifest
            else:  # the node-local copy (with the other nodes' ranks from the shared one), or the shared one
                chosen, copy = None, mine[step] if source == NVME else None
                if copy is not None and not _same(crc32c(str(copy.index.get("flush")).encode()), loader.world):
                    raise CheckpointError(f"nvme step {step}: the nodes' copies come from different flushes")
                shared = durables.get(step) or catalog.Durable(step, copy.path, {"world": world_size,
                                                                                  "ranks": list(range(world_size))})
                meta, nbytes = reader.restore(shared, entries, store.rank, world_size, loader.world, check_meta,
                                              local=copy)
        except CheckpointError as exc:
            failures.append(f"memory {exc}" if source == MEMORY else str(exc))  # "<source> step <s>: why"
            events.emit("restore_fallback", level=logging.ERROR, rank=store.rank, step=step, source=source,
                        error=str(exc))
            continue
        stale = _withdraw(store, held, step, chosen)
        if not store.readonly:
            local.withdraw(local_root, step, f"restore loaded step {step} from {source}")
        if store.rank == 0:
            events.emit("restore_source", level=logging.WARNING if failures or source != MEMORY else logging.INFO,
                        source=source, step=step,
                        reason=why((step, source), memory, durable, failures, nvme if local_root else None),
                        path=str(durables[step].path) if source == DURABLE else
                        str(mine[step].path) if source == NVME else str(store.dir))
        events.emit("restore_done", level=logging.WARNING if failures or stale or store.rejected else logging.INFO,
                    rank=store.rank, step=step, source=source, bytes=nbytes,
                    seconds=round(time.perf_counter() - t0, 6), skipped=len(stale) + len(store.rejected),
                    fallbacks=len(failures))
        return Restored(step, source, meta)
    raise IntegrityError("restore failed: no step held in memory or the durable tier by every rank could be loaded: "
                         + "; ".join(failures))


def _same(value: int, world: Any = None) -> bool:
    """Whether every rank passed the same `value` (collective over `world`)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return True
    t = torch.tensor([value, -value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=world)
    return int(t[0]) == -int(t[1])


def _withdraw(store: Any, held: Sequence[Version], step: int, chosen: Version | None) -> list[Version]:
    """Retire this rank's versions newer than `step`, and copies of `step` other than the one loaded."""
    stale = [v for v in held if v.step > step or (v.step == step and v is not chosen)]
    if not store.readonly:
        for v in stale:
            store.retire(v, f"restore loaded step {step}, an older one" if v.step > step else
                         f"a second version of step {step}" if chosen is not None else
                         f"restore loaded step {step} from the durable tier")
    return stale


def _none(rank: int, in_memory: bool, on_disk: bool, persist: Path | None) -> None:
    """Event `restore_none`: a fresh run (info), or a restart from step 0 although progress existed (error)."""
    if not (in_memory or on_disk):
        events.emit("restore_none", rank=rank, reason="fresh run: nothing in memory" +
                    (f" or in the durable tier {persist}" if persist else " and no durable tier configured"))
        return
    where = " and ".join(w for w, has in (("memory", in_memory), ("the durable tier", on_disk)) if has)
    events.emit("restore_none", level=logging.ERROR, rank=rank, persist=str(persist),
                reason=f"progress exists (in {where}, on some ranks) but no step is complete on every rank: "
                       "starting from step 0, every step so far is lost")
