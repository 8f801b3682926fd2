"""Rebuild after nodes are replaced (collective, before the trainers start): the newest step every slot holds or can
reconstruct is moved, decoded, verified and unpacked where it was lost, with its protection record; failing that, an
older step, none: NoCheckpointError. A step any node holds another job's version of is no candidate."""
from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpcft import events
from hpcft.agent.protection import stripes
from hpcft.agent.protection.bundle import Bundle, complete_steps, parse, unpack
from hpcft.agent.protection.codec import Unrecoverable, codec_for
from hpcft.agent.transport.link import COUNT
from hpcft.agent.transport.mesh import MeshBase
from hpcft.agent.protection.pins import Pins
from hpcft.agent.protection.placement import Placement
from hpcft.agent.protection.protect import (Record, commit_record, parity_meta, partner_meta, protect_dir, record_data,
                                            record_slot, records, retire, withdraw)
from hpcft.errors import IntegrityError, NoCheckpointError, StoreError
from hpcft.store.owner import Owner, adoption, refuse


LENGTH = range(-1, COUNT.stop)  # a length sent in a rebuild's header; -1: nothing of that kind follows
HELD = {"bundles": [COUNT], "records": [COUNT], "foreign": [COUNT]}  # each slot's steps, all-gathered to start


@dataclass(frozen=True)
class Outcome:
    """The step every slot now holds (None: nothing anywhere, a fresh run) and the slots that received a rebuilt
    copy of it."""
    step: int | None
    rebuilt: tuple[int, ...] = ()


def lost_slots(placement: Placement, bundles: Sequence[bool], held: Sequence[bool]) -> list[int]:
    """Slots without their bundle of a step, given which hold their bundle and their record of it; Unrecoverable if
    one cannot be rebuilt from the others (pure)."""
    missing = [s for s in range(placement.slots) if not bundles[s]]
    scheme = placement.scheme
    if not missing:
        return []
    if scheme.name == "none":
        raise Unrecoverable(f"slots {missing} lost their snapshot and protection is off (scheme none)")
    if scheme.name == "partner":
        for s in missing:
            if not held[placement.partner_of(s)]:
                raise Unrecoverable(f"slot {s} lost its snapshot and its partner slot {placement.partner_of(s)} "
                                    "holds no copy of it")
        return missing
    for pset in placement.sets:
        if any(m in missing for m in pset.members):
            stripes.check_recoverable(pset, [True if bundles[m] else None for m in pset.members],
                                      [True if held[m] else None for m in pset.members])
    return missing


def _fits(meta: dict[str, Any], placement: Placement, slot: int) -> bool:
    """A record written under this job's current protection layout for this slot (else it is not used)."""
    return (meta.get("scheme") == placement.scheme.name and meta.get("slots") == placement.slots
            and meta.get("slot") == slot)


class _Local:
    """This node's copies of one step, verified, or None where missing or bad: its bundle (pinned while held) and
    its record."""

    def __init__(self, step: int, complete: dict, recs: dict[int, Record], slot: int, pins: Pins):
        self.step = step
        self.bundle: Bundle | None = None
        self.record: Record | None = None
        self.record_bytes: np.ndarray | None = None
        self.record_damaged = False  # this node has a record of the step, but it failed its checks
        self._pinned = ExitStack()
        if step in complete:
            bundle = Bundle(step, complete[step])
            self._pinned.enter_context(pins.holding(bundle.pin_targets()))
            try:
                if not bundle.still_committed():
                    raise IntegrityError(f"step {step} was reused by the trainers before it could be pinned")
                bundle.verify()
                self.bundle = bundle
            except IntegrityError as exc:
                events.emit("rebuild_copy_bad", level=logging.ERROR, step=step, slot=slot, what="bundle",
                            error=str(exc))
                bundle.close()
                self._pinned.close()
        if step in recs:
            try:
                self.record_bytes = record_data(recs[step])
                self.record = recs[step]
            except (IntegrityError, StoreError, OSError, ValueError) as exc:  # StoreError: no data file
                self.record_damaged = True
                events.emit("rebuild_copy_bad", level=logging.ERROR, step=step, slot=slot, what="record",
                            error=str(exc))

    def close(self) -> None:
        if self.bundle is not None:
            self.bundle.close()
        self._pinned.close()


def rebuild(mesh: MeshBase, placement: Placement, job: Path, pins: Pins, job_id: str,
            root: str | None = None, ranks: Collection[int] | None = None) -> Outcome:
    """Collective: make every slot hold the newest step it can, rebuilding lost bundles (see module doc); `ranks`:
    the node's (`complete_steps`)."""
    t0 = time.perf_counter()
    complete = complete_steps(job, ranks=ranks)
    recs = {s: r for s, r in records(job).items() if _fits(r.meta, placement, mesh.slot)}
    foreign = refuse(((s, h.manifest) for s, by_rank in complete.items() for h in by_rank.values()),
                     Owner(job_id, adopt=adoption()), slot=mesh.slot, path=str(job))
    every = mesh.allgather({"bundles": sorted(complete), "records": sorted(recs), "foreign": sorted(foreign)}, HELD)
    refused = {s for h in every for s in h["foreign"]}
    steps = sorted({s for h in every for s in h["bundles"] + h["records"]} - refused, reverse=True)
    if not steps:
        return Outcome(None)
    reasons = []
    for step in steps:
        local = _Local(step, complete, recs, mesh.slot, pins)
        try:
            flags = mesh.allgather([local.bundle is not None, local.record is not None, local.record_damaged],
                                   (bool, bool, bool))
            gone = [slot for slot, f in enumerate(flags) if not f[0]]
            damaged = [slot for slot, f in enumerate(flags) if f[2]]
            if gone and damaged and not any(f[1] for f in flags):  # protected once, its records unusable now
                reasons.append(f"step {step}: the protection records of slot(s) {damaged} are damaged")
                events.emit("rebuild_fallback", level=logging.WARNING, slot=mesh.slot, step=step,
                            reason=f"step {step} was protected, but the records of slot(s) {damaged} are damaged "
                                   f"(rebuild_copy_bad) and slot(s) {gone} lost their copy: trying an older step")
                continue
            if gone and not any(f[1] for f in flags):  # the usual case for the newest step or two: say so
                reasons.append(f"step {step}: not protected yet")
                events.emit("rebuild_fallback", slot=mesh.slot, step=step,
                            reason=f"step {step} was not protected yet (no slot holds protection data of it) and "
                                   f"slot(s) {gone} lost their copy: trying an older step")
                continue
            try:
                targets = lost_slots(placement, [f[0] for f in flags], [f[1] for f in flags])
            except Unrecoverable as exc:
                why = str(exc) + (f" (the records of slot(s) {damaged} are damaged)" if damaged else "")
                reasons.append(f"step {step}: {why}")
                events.emit("rebuild_fallback", level=logging.WARNING, slot=mesh.slot, step=step, reason=why)
                continue
            error = _move(mesh, placement, local, targets, job, job_id, root) if targets else None
            errors = mesh.allgather(error, str | None)
        finally:
            local.close()
        if any(errors):
            reason = "; ".join(e for e in errors if e)
            reasons.append(f"step {step}: {reason}")
            events.emit("rebuild_fallback", level=logging.WARNING, slot=mesh.slot, step=step, reason=reason)
            continue
        events.emit("rebuild_done", slot=mesh.slot, step=step, rebuilt=",".join(map(str, targets)) or "none",
                    here=mesh.slot in targets, seconds=round(time.perf_counter() - t0, 6))
        _withdraw_newer(job, step, mesh.slot)
        return Outcome(step, tuple(targets))
    events.emit("rebuild_failed", level=logging.ERROR, slot=mesh.slot, steps=",".join(map(str, steps)),
                reason="no step is held or reconstructable on every slot; the persistent tier is the last resort")
    raise NoCheckpointError("no in-memory snapshot can be rebuilt on every node (" + "; ".join(reasons) +
                            "); restart from the persistent tier")


def _withdraw_newer(job: Path, step: int, slot: int) -> None:
    """Withdraw this node's records of steps newer than the rebuilt one: the trainers resume from `step`, so those
    records describe snapshots that will no longer exist."""
    newer = sorted(s for s in records(job) if s > step)
    pdir = protect_dir(job)
    for s in newer:
        withdraw(pdir, s)
    if newer:
        events.emit("protect_withdrawn", slot=slot, steps=",".join(map(str, newer)),
                    reason=f"the rebuild resumes from step {step}, older than these records")


def _move(mesh: MeshBase, placement: Placement, local: _Local, targets: list[int], job: Path, job_id: str,
          root: str | None) -> str | None:
    """Send what the targets need, receive and rebuild if this slot is one; the error text, or None."""
    senders = (_plan_partner if placement.scheme.name == "partner" else _plan_parity)(placement, targets)
    mine = [(dst, what) for src, dst, what in senders if src == mesh.slot]
    incoming = [(src, what) for src, dst, what in senders if dst == mesh.slot]
    with ThreadPoolExecutor(1) as pool, mesh.all_or_nothing():  # abort before the pool waits
        sent = pool.submit(_send, mesh, local, mine)
        got = _receive(mesh, incoming, local.step) if mesh.slot in targets else {}
        sent.result()
    if mesh.slot not in targets:
        return None
    try:
        _rebuild_here(mesh, placement, local.step, got, job, job_id, root)
    except IntegrityError as exc:
        events.emit("rebuild_corrupt", level=logging.ERROR, slot=mesh.slot, step=local.step, error=str(exc))
        return f"slot {mesh.slot}: {exc}"
    return None


def _plan_parity(placement: Placement, targets: list[int]) -> list[tuple[int, int, str]]:
    """(source, target, 'bundle+record') for every surviving member of a set toward each of its targets."""
    out = []
    for pset in placement.sets:
        lost = [m for m in pset.members if m in targets]
        out += [(m, t, "set") for t in lost for m in pset.members if m not in targets]
    return out


def _plan_partner(placement: Placement, targets: list[int]) -> list[tuple[int, int, str]]:
    """The copy of each target held by its partner, and the bundle its own record copies."""
    out = []
    for t in targets:
        out.append((placement.partner_of(t), t, "record"))
        if placement.partnered_by(t) not in targets:
            out.append((placement.partnered_by(t), t, "bundle"))
    return out


def _send(mesh: MeshBase, local: _Local, jobs: list[tuple[int, str]]) -> None:
    for dst, what in jobs:
        b = local.bundle if what in ("set", "bundle") else None
        r = local.record_bytes if what in ("set", "record") else None
        header = {"rebuild": local.step, "bundle": b.size if b else -1, "record": int(r.size) if r is not None else -1,
                  "meta": {k: v for k, v in local.record.meta.items() if k != "chunks"} if r is not None else None}
        mesh.send(dst, header, (b.piece(0, b.size) if b else []) + ([r] if r is not None else []))


def _receive(mesh: MeshBase, incoming: list[tuple[int, str]], step: int) -> dict[int, dict[str, Any]]:
    """{source slot: {"bundle": array|None, "record": array|None, "meta": dict|None}}, in parallel per source."""
    expected = {"rebuild": step, "bundle": LENGTH, "record": LENGTH, "meta": dict | None}

    def one(src: int) -> dict[str, Any]:
        header, payload = mesh.recv(src, shape=expected, what=f"its part of the rebuild of step {step}")
        nb, nr = header["bundle"], header["record"]
        mesh.channel(src).check({"bytes": payload.size}, {"bytes": max(nb, 0) + max(nr, 0)}, "its rebuild payload")
        return {"bundle": payload[:nb] if nb >= 0 else None,
                "record": payload[max(nb, 0):max(nb, 0) + nr] if nr >= 0 else None, "meta": header.get("meta")}

    sources = [src for src, _ in incoming]
    if len(set(sources)) != len(sources):  # partner with two slots: bundle and record come from one peer
        out: dict[int, dict[str, Any]] = {}
        for src in sources:
            got = one(src)
            merged = out.setdefault(src, {"bundle": None, "record": None, "meta": None})
            merged.update({k: v for k, v in got.items() if v is not None})
        return out
    with ThreadPoolExecutor(max(1, len(sources))) as pool, mesh.all_or_nothing():
        return dict(zip(sources, pool.map(one, sources)))


def _rebuild_here(mesh: MeshBase, placement: Placement, step: int, got: dict[int, dict[str, Any]], job: Path,
                  job_id: str, root: str | None) -> None:
    """Decode this slot's bundle and record from what arrived, verify, unpack, commit the record."""
    me = mesh.slot
    if placement.scheme.name == "partner":
        src = placement.partnered_by(me)
        payload = got[placement.partner_of(me)]["record"]
        if payload is None:
            raise IntegrityError(f"partner slot {placement.partner_of(me)} sent no copy of step {step}")
        theirs = got.get(src, {}).get("bundle")
        held, meta = (theirs, partner_meta(src, int(theirs.size), 0)) if theirs is not None else (None, None)
    else:
        pset = placement.set_of(me)
        metas = [(src, g["meta"]) for src, g in got.items() if g["meta"]]
        if not metas:
            raise IntegrityError(f"no surviving member of set {pset.index} sent a record of step {step}")
        src, meta = metas[0]
        sizes = mesh.channel(src).check(meta, {"sizes": (COUNT,) * pset.size}, "its record's layout")["sizes"]
        payloads = [got[m]["bundle"] if m in got else None for m in pset.members]
        parities = [got[m]["record"] if m in got else None for m in pset.members]
        for pos, p in enumerate(payloads):
            if p is not None and p.size != sizes[pos]:
                raise IntegrityError(f"slot {pset.members[pos]}'s bundle of step {step} has {p.size} bytes, "
                                     f"its set's records say {sizes[pos]}")
        codec = codec_for(placement.scheme.name, pset.size, pset.losses)
        full, par = stripes.rebuild_set(pset, payloads, parities, sizes, codec)
        pos = pset.members.index(me)
        payload, held = full[pos], par[pos]
        meta = parity_meta(pset, pos, sizes, stripes.piece_bytes(max(sizes), pset), 0)
    parts = parse(payload, step)  # every manifest and chunk checked before anything is written
    unpack(parts, job_id, root)
    if held is not None:
        _write_record(placement, me, step, held, meta, job)


def _write_record(placement: Placement, slot_index: int, step: int, held: np.ndarray, meta: dict[str, Any],
                  job: Path) -> None:
    pdir = protect_dir(job)
    data = record_slot(pdir, step)
    try:
        data.ensure(max(1, held.size))
        data.array[:held.size] = held
        commit_record(pdir, step, placement, slot_index, data, int(held.size), meta)
    finally:
        data.close()
    retire(pdir, 2)
