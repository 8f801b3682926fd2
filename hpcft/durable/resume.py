"""Where a restore comes from, and in which order (the design's restore order): the newest step complete on every
rank, in memory (own node's store: the agents rebuilt what a replaced node lost before the trainers started) or in
the durable tier; memory first at an equal step (local, and faster); on a failure the next older candidate of either
source, every rank together. The choice and why is event `restore_source`; a restart from step 0 although progress
existed is an error-level `restore_none` with its cause."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from hpcft import events
from hpcft.durable import catalog, reader
from hpcft.errors import CheckpointError, IntegrityError
from hpcft.snapshot.restore import Loader, held_everywhere
from hpcft.snapshot.state import Entry
from hpcft.store import Version

MEMORY, DURABLE = "memory", "durable"


@dataclass(frozen=True)
class Restored:
    """What a restore loaded: the step, from where, and the meta to apply (RNG, optimizer settings, `extra`,
    writer), a manifest's or a durable sidecar's."""
    step: int
    source: str
    meta: dict[str, Any]


def order(memory: Sequence[int], durable: Sequence[int]) -> list[tuple[int, str]]:
    """The candidates to try, newest step first, memory before the durable tier at an equal step (pure)."""
    return sorted([(s, MEMORY) for s in memory] + [(s, DURABLE) for s in durable],
                  key=lambda c: (-c[0], c[1] != MEMORY))


def why(first: tuple[int, str], memory: Sequence[int], durable: Sequence[int], failures: Sequence[str]) -> str:
    """The reason `restore_source` gives for loading `first` (pure)."""
    step, source = first
    if failures:
        return "fell back: " + "; ".join(failures)
    if source == MEMORY:
        newer = f" (durable newest {durable[0]})" if durable else " (no durable checkpoint complete everywhere)"
        return f"newest step complete in every rank's memory{newer}"
    if not memory:
        return "memory holds no step complete on every rank"
    return f"the durable step is newer than memory's best {memory[0]}"


def restore(loader: Loader, entries_fn: Callable[[], list[Entry]], persist: Path | None,
            check_meta: Callable[[dict[str, Any]], None] | None = None, world_size: int = 1) -> Restored | None:
    """Load the newest step complete on every rank from memory or `persist` (collective; see the module docstring);
    None on a fresh run. `entries_fn()` gives the live entries (called once, after the caller created optimizer
    state); `check_meta` checks what the caller will apply. After a load, every version this rank holds in memory
    that is newer than the step loaded (or a second copy of it) is withdrawn (event `version_withdrawn`): training
    writes those steps anew. IntegrityError if candidates existed but none could be loaded."""
    store = loader.store
    t0 = time.perf_counter()
    held = store.versions()
    memory, in_memory = held_everywhere(held, loader.world)
    durables = {d.step: d for d in catalog.checkpoints(persist)}
    durable, on_disk = held_everywhere(list(durables.values()), loader.world)
    candidates = order(memory, durable)
    if not candidates:
        _none(store.rank, in_memory, on_disk, persist)
        return None
    entries = entries_fn()
    failures: list[str] = []
    for step, source in candidates:
        try:
            if source == MEMORY:
                copies = [v for v in reversed(held) if v.step == step]  # the later written first
                chosen, nbytes = loader.load(copies, entries, check_meta)
                meta = chosen.manifest
            else:
                chosen = None
                meta, nbytes = reader.restore(durables[step], entries, store.rank, world_size, loader.world, check_meta)
        except CheckpointError as exc:
            failures.append(f"memory {exc}" if source == MEMORY else str(exc))  # "<source> step <s>: why"
            events.emit("restore_fallback", level=logging.ERROR, rank=store.rank, step=step, source=source,
                        error=str(exc))
            continue
        stale = _withdraw(store, held, step, chosen)
        if store.rank == 0:
            events.emit("restore_source", level=logging.WARNING if failures or source == DURABLE else logging.INFO,
                        source=source, step=step, reason=why((step, source), memory, durable, failures),
                        path=str(durables[step].path) if source == DURABLE else str(store.dir))
        events.emit("restore_done", level=logging.WARNING if failures or stale or store.rejected else logging.INFO,
                    rank=store.rank, step=step, source=source, bytes=nbytes,
                    seconds=round(time.perf_counter() - t0, 6), skipped=len(stale) + len(store.rejected),
                    fallbacks=len(failures))
        return Restored(step, source, meta)
    raise IntegrityError("restore failed: no step held in memory or the durable tier by every rank could be loaded: "
                         + "; ".join(failures))


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
