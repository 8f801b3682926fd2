"""The protect pass (collective): each node sends its bundle's pieces to their parity holders or its bundle to its
partner, and keeps what it receives as a record (`<job>/protect/step-<s>.{data,json}`, crc32c per chunk, committed by
rename). A step is protected once every node has its record; only then does a node let go of an older step."""
from __future__ import annotations

import logging
import operator
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpcft import events
from hpcft.agent.protection import stripes
from hpcft.agent.protection.bundle import Bundle, map_readonly
from hpcft.agent.protection.codec import CHUNK as FOLD, XorFold, codec_for
from hpcft.agent.transport.mesh import MeshBase
from hpcft.agent.protection.placement import Placement, ProtectionSet
from hpcft.agent.transport.link import COUNT, Link
from hpcft.errors import HpcftError, IntegrityError
from hpcft.store import Slot, crc32c, manifest as mf, secure_dir
from hpcft.store.slot import GROW_PIECE

CHUNK = 4 << 20
RECV_PIECE = 4 * FOLD  # 1 MiB: received at once, then folded a cache-sized cell at a time
SPARE = "spare.data"


@dataclass(frozen=True)
class Record:
    """What one node keeps for a protected step: parity blocks of its set, or its partner's bundle."""
    step: int
    path: Path
    meta: dict[str, Any]


def protect_dir(job: Path) -> Path:
    return secure_dir(job / "protect")


def records(job: Path) -> dict[int, Record]:
    """This node's committed protection records by step (unreadable ones are skipped with an event)."""
    out = {}
    for path in sorted((job / "protect").glob("step-*.json")):
        try:
            meta = mf.read(path)
        except HpcftError as exc:
            events.emit("protect_record_bad", level=logging.WARNING, path=str(path), error=str(exc))
            continue
        out[int(meta["step"])] = Record(int(meta["step"]), path, meta)
    return out


def protect_step(mesh: MeshBase, placement: Placement, bundle: Bundle, job: Path, keep: int = 2,
                 started: float | None = None) -> Record:
    """Protect `bundle` with every other agent (collective), once every node has committed its record; StaleStep on
    every node (each withdrawing its record) if any node's copy was reused. `started`: perf_counter at the start."""
    t0 = time.perf_counter() if started is None else started
    scheme = placement.scheme
    sizes = mesh.exchange(placement.exchange_peers(mesh.slot), bundle.size, COUNT)  # the set's (the partners') sizes
    pdir = protect_dir(job)
    slot = record_slot(pdir, bundle.step)
    try:
        if scheme.name == "partner":
            held, meta = _partner(mesh, placement, bundle, slot, sizes)
        else:
            held, meta = _parity(mesh, placement, bundle, slot, sizes)
        stale = None if bundle.still_committed() else f"step {bundle.step} was overwritten while it was being protected"
        path = commit_record(pdir, bundle.step, placement, mesh.slot, slot, held, meta) if stale is None else None
    finally:
        slot.close()
    # the commit barrier: only once every node has committed may a node retire older records (or release their pins);
    # a peer lost here fails the agreement, and the record stays beside the older ones for the rebuild to weigh
    if not mesh.allreduce(stale is None, operator.and_, bool):
        withdraw(pdir, bundle.step)
        raise StaleStep(stale or f"step {bundle.step} was overwritten on another node while it was being protected")
    retire(pdir, keep)
    events.emit("snapshot_protected", step=bundle.step, slot=mesh.slot, scheme=scheme.name, held_bytes=held,
                sent_bytes=meta["sent_bytes"], seconds=round(time.perf_counter() - t0, 6))
    return Record(bundle.step, path, meta)


def withdraw(pdir: Path, step: int) -> None:
    """Remove this node's record of `step`, manifest first (so it is never torn), its data file recycled."""
    (pdir / f"step-{step}.json").unlink(missing_ok=True)
    _recycle(pdir / f"step-{step}.data")


class StaleStep(HpcftError):
    """The trainers reused the store slot of the step being protected before the pass ended."""


def commit_record(pdir: Path, step: int, placement: Placement, slot_index: int, data: Slot, held: int,
                  meta: dict[str, Any]) -> Path:
    """Publish the `held` bytes of `data` as this node's record of `step` (crc32c per chunk, committed by rename)."""
    meta = {**meta, "step": step, "scheme": placement.scheme.name, "slot": slot_index, "slots": placement.slots,
            "bytes": held, "chunks": [[lo, min(CHUNK, held - lo), crc32c(data.array[lo:min(held, lo + CHUNK)])]
                                      for lo in range(0, held, CHUNK)]}
    path = pdir / f"step-{step}.json"
    mf.write_atomic(path, meta)
    return path


def record_data(record: Record) -> np.ndarray:
    """The held bytes of `record`, mapped read-only and checked against its chunk crc32c (IntegrityError)."""
    data = map_readonly(record.path.with_suffix(".data"), int(record.meta["bytes"]))
    for lo, n, crc in record.meta["chunks"]:
        if crc32c(data[lo:lo + n]) != crc:
            events.emit("protect_chunk_lost", level=logging.ERROR, step=record.step, offset=lo, path=str(record.path))
            raise IntegrityError(f"protection record {record.path}: chunk at offset {lo} fails its crc32c")
    return data


def parity_meta(pset: ProtectionSet, position: int, sizes: list[int], nbytes: int, sent: int) -> dict[str, Any]:
    """The scheme-specific fields of a parity record (what a rebuild needs to decode the set)."""
    return {"kind": "parity", "set": pset.index, "members": list(pset.members), "position": position,
            "losses": pset.losses, "sizes": sizes, "piece_bytes": nbytes, "sent_bytes": sent}


def partner_meta(source: int, source_bytes: int, sent: int) -> dict[str, Any]:
    """The scheme-specific fields of a partner record: whose bundle it copies, and its length."""
    return {"kind": "partner", "source": source, "source_bytes": source_bytes, "sent_bytes": sent}


def _partner(mesh: MeshBase, placement: Placement, bundle: Bundle, slot: Slot, sizes: dict[int, int]):
    dst, src = placement.partner_of(mesh.slot), placement.partnered_by(mesh.slot)
    slot.ensure(max(1, sizes[src]), pace=mesh.pace)
    with ThreadPoolExecutor(1) as pool, mesh.all_or_nothing():  # abort before the pool waits
        sent = pool.submit(mesh.send, dst, {"step": bundle.step, "kind": "bundle"}, bundle.piece(0, bundle.size))
        _, got = mesh.recv(src, into=slot.array[:sizes[src]], shape={"step": bundle.step, "kind": "bundle"},
                           what=f"a copy of its bundle of step {bundle.step}")
        mesh.channel(src).check({"bytes": got.size}, {"bytes": sizes[src]}, "a copy of its bundle")
        sent.result()
    return sizes[src], partner_meta(src, sizes[src], bundle.size)


def _parity(mesh: MeshBase, placement: Placement, bundle: Bundle, slot: Slot, sizes: dict[int, int]):
    pset = placement.set_of(mesh.slot)
    pos = pset.members.index(mesh.slot)
    set_sizes = [sizes[m] for m in pset.members]
    nbytes = stripes.piece_bytes(max(set_sizes), pset)
    codec = codec_for(placement.scheme.name, pset.size, pset.losses)
    held = stripes.parity_bytes(pset, pos, nbytes)
    slot.ensure(max(1, held), pace=mesh.pace)
    mine = pset.stripes_holding(pos)
    senders = sorted({d for s in mine for d in pset.data_positions(s)})
    if placement.scheme.name == "xor":  # fold each piece into the parity block as it arrives
        folds = {s: XorFold(stripes.parity_block(slot.array, pset, pos, s, nbytes)) for s in mine}
        scratch = {d: np.empty(RECV_PIECE, dtype=np.uint8) for d in senders}

        def take(d: int, s: int, ch: Link, plen: int) -> None:
            buf = scratch[d]
            for off in range(0, plen, RECV_PIECE):  # fewer, larger receives: less CPU per byte than one per cell
                n = min(RECV_PIECE, plen - off)
                ch.recv_payload(buf[:n])
                for lo in range(0, n, FOLD):
                    folds[s].add(off + lo, buf[lo:min(n, lo + FOLD)])
    else:  # RS needs every data block of a stripe at once: keep them, in buffers reused pass after pass
        inbox_all = _inbox(len(mine) * pset.data_pieces * nbytes, mesh.pace)
        inbox = {(s, d): inbox_all[(i * pset.data_pieces + j) * nbytes:(i * pset.data_pieces + j + 1) * nbytes]
                 for i, s in enumerate(mine) for j, d in enumerate(pset.data_positions(s))}
        arrived: dict[tuple[int, int], np.ndarray] = {}

        def take(d: int, s: int, ch: Link, plen: int) -> None:
            ch.recv_payload(inbox[(s, d)][:plen])
            arrived[(s, d)] = inbox[(s, d)][:plen]

    def send_all() -> int:
        sent = 0
        for s in range(pset.size):
            if pos not in pset.data_positions(s):
                continue
            i = pset.piece_of(pos, s)
            views = list(bundle.slices(i * nbytes, (i + 1) * nbytes))  # unpadded: a short piece is zero-extended
            for h in pset.parity_positions(s):
                mesh.send(pset.members[h], {"step": bundle.step, "stripe": s}, views)
                sent += nbytes
        return sent

    def recv_from(d: int) -> None:
        ch = mesh.channel(pset.members[d])
        for s in mine:
            if d in pset.data_positions(s):
                header, plen = ch.recv_header()
                ch.check({**header, "bytes": plen}, {"stripe": s, "step": bundle.step, "bytes": range(nbytes + 1)},
                         f"a piece of stripe {s} of step {bundle.step}")
                take(d, s, ch, plen)

    with ThreadPoolExecutor(1 + len(senders)) as pool, mesh.all_or_nothing():  # abort before the pool waits
        sent = pool.submit(send_all)
        for f in [pool.submit(recv_from, d) for d in senders]:
            f.result()
        sent_bytes = sent.result()
    if placement.scheme.name == "xor":
        for fold in folds.values():
            fold.finish()
    else:
        for s in mine:
            t = pset.parity_positions(s).index(pos)
            stripes.encode_paced(codec, [arrived[(s, d)] for d in pset.data_positions(s)], t,
                                 stripes.parity_block(slot.array, pset, pos, s, nbytes), mesh.pace)
    return held, parity_meta(pset, pos, set_sizes, nbytes, sent_bytes)


_INBOX: list[np.ndarray] = []


def _inbox(nbytes: int, pace: Callable[[], None]) -> np.ndarray:
    """A buffer of at least `nbytes`, kept for the agent's life so its pages are faulted in once, a piece at a time
    under the CPU cap (`pace`), not per pass while receiving."""
    if not _INBOX or _INBOX[0].size < nbytes:
        buf = np.empty(nbytes, dtype=np.uint8)
        for lo in range(0, nbytes, GROW_PIECE):
            pace()
            buf[lo:lo + GROW_PIECE] = 1
        _INBOX[:] = [buf]
    return _INBOX[0][:nbytes]


def record_slot(pdir: Path, step: int) -> Slot:
    """The data file of `step`'s record, any record of it withdrawn first (a rerun), reusing the pages of the last
    retired one (`spare.data`): fresh shared-memory pages cost ten times a copy to fault in."""
    (pdir / f"step-{step}.json").unlink(missing_ok=True)
    path = pdir / f"step-{step}.data"
    spare = pdir / SPARE
    if not path.exists() and spare.exists():
        os.replace(spare, path)
    return Slot(step, path)


def retire(pdir: Path, keep: int) -> None:
    """Keep the newest `keep` records; withdraw older ones (one data file kept as `spare.data` for the next pass)
    and any data file without a record."""
    steps = sorted(int(p.stem.split("-")[1]) for p in pdir.glob("step-*.json"))
    for step in steps[:-keep]:
        withdraw(pdir, step)
    drop_orphans(pdir)


def drop_orphans(pdir: Path) -> None:
    """Recycle the data files without a record (left by a pass that died or withdrew)."""
    for data in pdir.glob("step-*.data"):
        if not data.with_suffix(".json").exists():
            _recycle(data)


def _recycle(data: Path) -> None:
    spare = data.with_name(SPARE)
    with suppress(FileNotFoundError):
        if spare.exists():
            data.unlink()
        else:
            os.replace(data, spare)
