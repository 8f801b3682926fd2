"""hpcft's reader of a durable checkpoint, unpickling nothing: the sidecars say where every chunk's bytes sit and their
crc32c; for each live entry it finds rows that tile the box this rank needs (its own first, then its data-parallel
group's, then anyone's: a reshard), reads and verifies them and copies the overlap in. A failed row (or a missing
file, a torn sidecar) loses the whole checkpoint: the caller falls back to an older one."""
from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from hpcft import events
from hpcft.durable import boxes, catalog, items, seal
from hpcft.durable.boxes import Box
from hpcft.durable.commit import (CRC, DATA, DTYPE, FQN, LENGTH, NBYTES, OFFSETS, RECORD, SHAPE, SIZES,
                                  chunks_by_fqn)
from hpcft.durable.files import failing
from hpcft.durable.flush import UNSEALED_FORMAT, data_name, read_sidecar, sidecar
from hpcft.errors import CheckpointError, HpcftError, IntegrityError, ManifestError
from hpcft.snapshot.restore import LOST, MISMATCH, OK, agree
from hpcft.snapshot.schema import is_count
from hpcft.snapshot.state import Entry
from hpcft.store import crc32c
from hpcft.store.manifest import is_int

Rows = dict[str, list[tuple[tuple[int, list], Box]]]  # fqn -> [((rank, row), its box)]


def check_row(row: Any, where: str) -> None:
    """ManifestError unless `row` is a chunk the reader can place: names and dtype, a box inside its shape, its byte
    count, and its data inside its record."""
    ok = isinstance(row, list) and len(row) == 11 and all(isinstance(row[i], str) for i in (FQN, DTYPE))
    ok = ok and all(isinstance(row[i], list) and all(map(is_count, row[i])) for i in (SHAPE, OFFSETS, SIZES))
    ok = ok and len(row[SHAPE]) == len(row[OFFSETS]) == len(row[SIZES]) \
        and all(o + n <= s for s, o, n in zip(row[SHAPE], row[OFFSETS], row[SIZES]))
    ok = ok and all(is_count(row[i]) for i in (DATA, NBYTES, CRC, RECORD, LENGTH)) \
        and row[RECORD] <= row[DATA] and row[DATA] + row[NBYTES] <= row[RECORD] + row[LENGTH]
    try:
        ok = ok and row[NBYTES] == math.prod(row[SIZES]) * items.element_size(row[DTYPE])
    except ValueError:
        ok = False
    if not ok:
        raise ManifestError(f"{where} has a chunk row the reader cannot place: {str(row)[:200]}")


class Checkpoint:
    """One complete durable checkpoint, its sidecars read (and checked) as they are needed and its data files
    opened once; `read(rank, row)` is a chunk's verified bytes."""

    def __init__(self, durable: catalog.Durable, local: catalog.Durable | None = None):
        self.step, self.path = durable.step, durable.path
        self.world = durable.index.get("world")
        if not is_count(self.world) or durable.index.get("ranks") != list(range(self.world)):
            raise ManifestError(f"{self.path}'s index does not list the ranks 0..world-1")
        # the view of a node-local copy (hpcft.durable.local): its ranks read there, the others from `durable`
        self.local = local.path if local is not None else None
        self._here = set(local.index.get("ranks") or ()) if local is not None else set()
        self._sides: dict[int, dict[str, Any]] = {}
        self._fds: dict[int, int] = {}
        self.nbytes = 0
        self.ambiguous: set[str] = set()  # names several ranks saved with their own content (known after `every`)
        self.sealed = durable.index.get("sealed") is True  # every sidecar carries the seal (hpcft.durable.seal)
        self.unsealed = 0  # sidecars read that were written before the seal

    def side(self, rank: int) -> dict[str, Any]:
        """Rank `rank`'s sidecar, checked against the seal it carries; its `meta` is what the seal covers."""
        if rank not in self._sides:
            path = sidecar(self.dir(rank), rank)
            s = read_sidecar(path)
            if s.get("rank") != rank or s.get("step") != self.step or s.get("file") != data_name(rank) \
                    or not isinstance(s.get("items"), list):
                raise ManifestError(f"{path} is not rank {rank}'s sidecar of step {self.step}")
            for row in s["items"]:
                check_row(row, str(path))
            if seal.sealed(s):
                s = {**s, "meta": seal.applied(seal.check(s, path, self.step, self.world))}
            else:
                self._unsealed(path)
            if not isinstance(s.get("meta"), dict):
                raise ManifestError(f"{path} is not rank {rank}'s sidecar of step {self.step}: it has no meta")
            self._sides[rank] = s
        return self._sides[rank]

    def _unsealed(self, path: Path) -> None:
        """A sidecar written before the seal: refused where the index says all were sealed, else read with a warning."""
        if self.sealed:
            raise ManifestError(f"{path} is not sealed ({UNSEALED_FORMAT}), but its checkpoint's index says every "
                                "sidecar was: it was replaced or rewritten")
        self.unsealed += 1
        events.emit("durable_unsealed", level=logging.WARNING, step=self.step, path=str(path),
                    reason="written by an hpcft older than the seal: its rows and what a restore applies are "
                           "checked by nothing but the sidecar's own checksum")

    def dir(self, rank: int) -> Path:
        """Where rank `rank`'s sidecar and data file are read: the node-local copy if it holds them."""
        return self.local if rank in self._here and self.local is not None else self.path

    def rows(self, ranks: Sequence[int]) -> Rows:
        out: Rows = {}
        for r in ranks:
            for row in self.side(r)["items"]:
                out.setdefault(row[FQN], []).append(((r, row), Box(tuple(row[OFFSETS]), tuple(row[SIZES]))))
        return out

    def every(self) -> tuple[Rows, list[str]]:
        """Every rank's rows as DCP's metadata lists them (a name several ranks hold with their own content: the
        lowest rank's), and those names."""
        chosen, ambiguous = chunks_by_fqn({r: self.side(r) for r in range(self.world)})
        self.ambiguous = set(ambiguous)
        return {n: [(rr, Box(tuple(rr[1][OFFSETS]), tuple(rr[1][SIZES]))) for rr in got]
                for n, got in chosen.items()}, ambiguous

    def read(self, rank: int, row: list) -> np.ndarray:
        """The chunk's raw bytes, verified against its crc32c (IntegrityError, event `durable_chunk_lost`)."""
        path = self.dir(rank) / data_name(rank)
        if rank not in self._fds:
            with failing(f"cannot open {path}", IntegrityError):
                self._fds[rank] = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        buf = np.empty(row[NBYTES], dtype=np.uint8)
        done = 0
        while done < len(buf):
            with failing(f"cannot read {path}", IntegrityError):
                n = os.preadv(self._fds[rank], [memoryview(buf)[done:]], row[DATA] + done)
            if n <= 0:
                raise IntegrityError(f"{path} ends before the chunk of {row[FQN]} at byte {row[DATA] + done}")
            done += n
        if crc32c(buf) != row[CRC]:
            events.emit("durable_chunk_lost", level=logging.ERROR, step=self.step, path=str(path), name=row[FQN],
                        offset=row[DATA])
            raise IntegrityError(f"the chunk of {row[FQN]} at byte {row[DATA]} of {path} fails its crc32c")
        self.nbytes += len(buf)
        return buf

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def fill(dst: torch.Tensor, parts: Sequence[boxes.Part], ckpt: Checkpoint) -> None:
    """Copy every part (its row read and verified) into `dst`, the tensor holding the box the parts tile."""
    for part in parts:
        rank, row = part.row
        raw = torch.from_numpy(ckpt.read(rank, row))
        src = raw.view(getattr(torch, row[DTYPE])).reshape(row[SIZES])
        dst[part.dst].copy_(src[part.src])


def _tiers(ckpt: Checkpoint, rank: int | None) -> Iterator[tuple[str, Callable[[], Rows]]]:
    """Where a rank looks for rows, best first: its own (same world), its data-parallel group's, everyone's."""
    if rank is not None:
        yield "own", lambda: ckpt.rows([rank])
        group = sorted({r for r in ckpt.side(rank).get("group") or [] if is_int(r) and 0 <= r < ckpt.world} | {rank})
        if len(group) > 1:
            yield "group", lambda: ckpt.rows(group)
    yield "any", lambda: ckpt.every()[0]


def load(ckpt: Checkpoint, entries: Sequence[Entry], rank: int) -> dict[str, str]:
    """Fill every live entry of `rank` from `ckpt`; the tier each came from (name -> own/group/any). CheckpointError
    when the checkpoint does not hold an entry's box (another model, dtype or shape); IntegrityError when a chunk
    is lost; ManifestError when a sidecar lies."""
    me = rank if rank < ckpt.world else None
    tiers = list(_tiers(ckpt, me))
    cache: dict[str, Rows] = {}

    def rows_of(i: int, name: str, dtype: str, shape: tuple[int, ...]) -> list[tuple[Any, Box]]:
        kind, make = tiers[i]
        if kind not in cache:
            cache[kind] = make()
        got = cache[kind].get(name, [])
        for (r, row), _ in got:
            if row[DTYPE] != dtype or tuple(row[SHAPE]) != shape:
                raise CheckpointError(f"durable step {ckpt.step} holds {name} as {row[DTYPE]} {row[SHAPE]} (rank {r}); "
                                      f"live it is {dtype} {list(shape)}: restore into the same model and optimizer")
        return got

    used = {}
    for e in entries:
        d = e.describe()
        name = items.fqn(e.name)
        shape, offsets = items.place(d)
        want = Box(offsets, tuple(d["shape"]))
        got = boxes.select(want, (rows_of(i, name, d["dtype"], shape) for i in range(len(tiers))))
        if got is None:
            raise CheckpointError(f"durable step {ckpt.step} does not hold {e.name} ({name}) elements "
                                  f"{list(want.offsets)} + {list(want.sizes)} of {list(shape)}: restore into the "
                                  "model and optimizer it was written from")
        tier, parts = got
        fill(e.local, parts, ckpt)
        used[e.name] = tiers[tier][0]
    guessed = sorted(n for n, t in used.items() if t == "any" and items.fqn(n) in ckpt.ambiguous)
    if guessed:
        events.emit("durable_ambiguous", level=logging.WARNING, rank=rank, step=ckpt.step, count=len(guessed),
                    names=",".join(guessed[:20]), reason="several saved ranks hold these names with their own content "
                    "and this rank has no saved counterpart: it takes the lowest rank's, as a DCP reader does")
    return used


def meta_rank(ckpt: Checkpoint, rank: int) -> int:
    """Whose RNG state and `extra` rank `rank` takes: its own where the checkpoint has that rank, else saved rank
    `rank % world` (a grown job: docs/reference/durable.md, said by event `durable_reshard`)."""
    return rank if rank < ckpt.world else rank % ckpt.world


def restore(durable: catalog.Durable, entries: Sequence[Entry], rank: int, world_size: int, world: Any = None,
            check_meta: Callable[[dict[str, Any]], None] | None = None,
            local: catalog.Durable | None = None) -> tuple[dict[str, Any], int]:
    """Load `durable` (through this node's copy `local`, if given) into `entries` on every rank (collective over
    `world`): this rank's meta (see `meta_rank`) and the bytes read. Every rank raises together if any failed:
    IntegrityError when one lost a chunk, sidecar or file (event `durable_lost`), CheckpointError on a mismatch."""
    code, why, meta, ckpt = OK, "", {}, None
    try:
        ckpt = Checkpoint(durable, local)
        src = meta_rank(ckpt, rank)
        meta = ckpt.side(src)["meta"]
        if not isinstance(meta.get("rng"), dict) or not all(isinstance(meta.get(k), (dict, type(None)))
                                                            for k in ("extra", "optim")):
            raise ManifestError(f"rank {src}'s sidecar of durable step {durable.step} has no RNG state object, or "
                                "its extra or optimizer settings are not objects")
        if check_meta is not None:
            check_meta(meta)
        used = load(ckpt, entries, rank)
    except Exception as exc:  # anything unforeseen loses the checkpoint here too: no rank may wait in `agree` alone
        mismatch = isinstance(exc, CheckpointError) and not isinstance(exc, IntegrityError)  # ManifestError: lost
        code, why = (MISMATCH if mismatch else LOST), (str(exc) if isinstance(exc, HpcftError)
                                                        else f"{type(exc).__name__}: {exc}")
        if not mismatch:
            events.emit("durable_lost", level=logging.ERROR, rank=rank, step=durable.step, path=str(durable.path),
                        error=why)
    finally:
        if ckpt is not None:
            ckpt.close()
    worst = agree(code, world)
    if worst != OK:
        why = why or ("another rank lost a chunk of this checkpoint" if worst == LOST
                      else "another rank's state does not match this checkpoint")
        raise (IntegrityError if worst == LOST else CheckpointError)(f"durable step {durable.step}: {why}")
    resharded = sum(1 for t in used.values() if t == "any")
    if ckpt.world != world_size or src != rank:
        events.emit("durable_reshard", level=logging.WARNING, rank=rank, step=durable.step, saved_world=ckpt.world,
                    world=world_size, meta_from=src, resharded=resharded,
                    reason="the checkpoint was written by another world size: tensors resharded; RNG state and "
                           f"extra taken from saved rank {src}")
    return meta, ckpt.nbytes
