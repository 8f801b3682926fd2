"""The protect pass (collective over the agents' mesh): for one step every node holds, each node sends
the pieces of its bundle to their parity holders (xor/rs) or its whole bundle to its partner, and keeps
what it receives in `<job>/protect/step-<s>.{data,json}`: a record committed by rename, with crc32c
per chunk. A record on every node of a set means the step is protected; none is ever partially visible."""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpcft import events
from hpcft.agent import stripes
from hpcft.agent.bundle import Bundle, map_readonly
from hpcft.agent.codec import codec_for
from hpcft.agent.mesh import Mesh
from hpcft.agent.placement import Placement, ProtectionSet
from hpcft.errors import HpcftError, IntegrityError
from hpcft.store import Slot, crc32c, secure_dir
from hpcft.store import manifest as mf

CHUNK = 4 << 20


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


def protect_step(mesh: Mesh, placement: Placement, bundle: Bundle, job: Path, keep: int = 2) -> Record:
    """Protect `bundle` (this node's step) with every other agent doing the same step (collective)."""
    t0 = time.perf_counter()
    scheme = placement.scheme
    sizes = mesh.allgather(bundle.size)
    pdir = protect_dir(job)
    (pdir / f"step-{bundle.step}.json").unlink(missing_ok=True)  # a rerun: withdraw before overwriting
    slot = Slot(bundle.step, pdir / f"step-{bundle.step}.data")
    try:
        if scheme.name == "partner":
            held, meta = _partner(mesh, placement, bundle, slot, sizes)
        else:
            held, meta = _parity(mesh, placement, bundle, slot, sizes)
        if not bundle.still_committed():
            raise StaleStep(f"step {bundle.step} was overwritten while it was being protected")
        path = commit_record(pdir, bundle.step, placement, mesh.slot, slot, held, meta)
    finally:
        slot.close()
    retire(pdir, keep)
    events.emit("snapshot_protected", step=bundle.step, slot=mesh.slot, scheme=scheme.name, held_bytes=held,
                sent_bytes=meta["sent_bytes"], seconds=round(time.perf_counter() - t0, 6))
    return Record(bundle.step, path, meta)


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


def _partner(mesh: Mesh, placement: Placement, bundle: Bundle, slot: Slot, sizes: list[int]):
    dst, src = placement.partner_of(mesh.slot), placement.partnered_by(mesh.slot)
    slot.ensure(max(1, sizes[src]))
    with ThreadPoolExecutor(1) as pool, mesh.all_or_nothing():  # abort before the pool waits
        sent = pool.submit(mesh.send, dst, {"step": bundle.step, "kind": "bundle"}, bundle.piece(0, bundle.size))
        mesh.recv(src, into=slot.array[:sizes[src]])
        sent.result()
    return sizes[src], partner_meta(src, sizes[src], bundle.size)


def _parity(mesh: Mesh, placement: Placement, bundle: Bundle, slot: Slot, sizes: list[int]):
    pset = placement.set_of(mesh.slot)
    pos = pset.members.index(mesh.slot)
    set_sizes = [sizes[m] for m in pset.members]
    nbytes = stripes.piece_bytes(max(set_sizes), pset)
    codec = codec_for(placement.scheme.name, pset.size, pset.losses)
    held = stripes.parity_bytes(pset, pos, nbytes)
    slot.ensure(max(1, held))
    mine = pset.stripes_holding(pos)
    inbox = {(s, d): np.empty(nbytes, dtype=np.uint8) for s in mine for d in pset.data_positions(s)}

    def send_all() -> int:
        sent = 0
        for s in range(pset.size):
            if pos not in pset.data_positions(s):
                continue
            i = pset.piece_of(pos, s)
            for h in pset.parity_positions(s):
                mesh.send(pset.members[h], {"step": bundle.step, "stripe": s}, bundle.piece(i * nbytes, (i + 1) * nbytes))
                sent += nbytes
        return sent

    def recv_from(d: int) -> None:
        for s in mine:
            if d in pset.data_positions(s):
                header, _ = mesh.recv(pset.members[d], into=inbox[(s, d)])
                if header.get("stripe") != s or header.get("step") != bundle.step:
                    raise HpcftError(f"agent {pset.members[d]} sent {header}, expected stripe {s} of step {bundle.step}")

    senders = sorted({d for s in mine for d in pset.data_positions(s)})
    with ThreadPoolExecutor(1 + len(senders)) as pool, mesh.all_or_nothing():  # abort before the pool waits
        sent = pool.submit(send_all)
        for f in [pool.submit(recv_from, d) for d in senders]:
            f.result()
        sent_bytes = sent.result()
    for s in mine:
        t = pset.parity_positions(s).index(pos)
        codec.encode_some([inbox[(s, d)] for d in pset.data_positions(s)],
                          {t: stripes.parity_block(slot.array, pset, pos, s, nbytes)})
    return held, parity_meta(pset, pos, set_sizes, nbytes, sent_bytes)


def retire(pdir: Path, keep: int) -> None:
    """Keep the newest `keep` records; remove older ones (manifest first, so no record is ever torn) and any
    data file without a record (left by a pass that died before committing)."""
    steps = sorted(int(p.stem.split("-")[1]) for p in pdir.glob("step-*.json"))
    for step in steps[:-keep]:
        (pdir / f"step-{step}.json").unlink(missing_ok=True)
        (pdir / f"step-{step}.data").unlink(missing_ok=True)
    for data in pdir.glob("step-*.data"):
        if not data.with_suffix(".json").exists():
            data.unlink(missing_ok=True)
