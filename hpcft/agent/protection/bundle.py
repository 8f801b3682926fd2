"""One node's snapshot of one step as a single byte string (the unit the agent protects), read without opening the
store for writing: a length-prefixed JSON header, then per local rank its committed manifest bytes and data bytes.
On a replacement node, `parse` + `unpack` turn a rebuilt bundle back into committed rank-store versions."""
from __future__ import annotations

import json
import logging
import mmap
import os
import shutil
import struct
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpcft import events
from hpcft.agent.transport.link import COUNT, mismatch
from hpcft.agent.transport.throttle import Throttle
from hpcft.errors import IntegrityError, StoreError
from hpcft.store import crc32c, seal, seal_key, manifest as mf, pin as store_pin, writer
from hpcft.store.owner import Owner, stranger
from hpcft.store.paths import DATA, open_file, read_file, ranks, slot_file, slot_files

_LEN = struct.Struct("!Q")
_HEADER = {"step": COUNT, "ranks": [{"rank": COUNT, "manifest_bytes": COUNT, "data_bytes": COUNT}]}


@dataclass(frozen=True)
class Held:
    """A committed version of one rank as found on disk: its manifest (raw bytes and parsed) and data file."""
    rank: int
    step: int
    manifest_path: Path
    manifest_bytes: bytes
    manifest: dict
    data_path: Path


# manifest path -> (its file's identity, what was read from it). Manifests are only replaced by rename, so an unchanged
# (inode, size, ctime) is an unchanged manifest: re-reading them every round (~1.5 ms of CPU each at 50M parameters)
# took a large part of the agent's CPU cap.
_SEEN: dict[Path, tuple[tuple[int, int, int], Held]] = {}


def local_versions(job: Path) -> dict[int, dict[int, Held]]:
    """step → rank → Held, for every committed version of every rank directory under the job dir."""
    found: dict[int, dict[int, Held]] = {}
    present = set()
    for rank, rdir in ranks(job).items():
        for k, mpath in slot_files(rdir).items():
            try:
                st = mpath.stat()
                key = (st.st_ino, st.st_size, st.st_ctime_ns)
                seen = _SEEN.get(mpath)
                if seen is not None and seen[0] == key:
                    held = seen[1]
                else:
                    raw = read_file(mpath)
                    parsed = mf.decode(raw, mpath)
                    held = Held(rank, int(parsed["step"]), mpath, raw, parsed, slot_file(rdir, k, DATA))
                    _SEEN[mpath] = (key, held)
            except (OSError, StoreError) as exc:  # withdrawn under us, or torn: not a version
                logging.getLogger(__name__).debug("skipping %s: %s", mpath, exc)
                continue
            present.add(mpath)
            found.setdefault(held.step, {})[held.rank] = held
    for gone in [p for p in _SEEN if p.is_relative_to(job) and p not in present]:
        del _SEEN[gone]
    return found


def complete_steps(job: Path, versions: dict[int, dict[int, Held]] | None = None,
                   ranks: Collection[int] | None = None) -> dict[int, dict[int, Held]]:
    """The steps every one of the node's `ranks` holds (the node's complete versions, of those ranks), newest last;
    from `versions` when given. `ranks` None: every rank directory here. A store also keeps the directories of ranks
    the node ran before a requeue moved it to another slot: counted, they would leave no step complete."""
    versions = local_versions(job) if versions is None else versions
    want = {r for by_rank in versions.values() for r in by_rank} if ranks is None else set(ranks)
    return dict(sorted((s, {r: h for r, h in v.items() if r in want}) for s, v in versions.items()
                       if want and want <= set(v)))


def by_rank(versions: dict[int, dict[int, Held]], mine: Collection[int] | None = None) -> dict[int, list[int]]:
    """rank → the steps it holds, from `local_versions`, for the ranks of `mine` (None: every rank here)."""
    out: dict[int, list[int]] = {}
    for step, held in versions.items():
        for r in held:
            if mine is None or r in mine:
                out.setdefault(r, []).append(step)
    return out


def release_others(job: Path, mine: Collection[int], protected: int, slot: int) -> dict[int, int]:
    """Remove the directories of the ranks this node no longer runs (kept from a slot it ran before a requeue moved
    it: no restore reads them) whose every version is older than `protected`, a step protected everywhere since, and
    that no process writes: their memory goes back to the trainers (event `store_released`). {rank: bytes freed}."""
    others = {r: d for r, d in ranks(job).items() if r not in mine}
    if not others:  # the usual case, once per protected step: no manifest is looked at
        return {}
    held = by_rank(local_versions(job), others)
    freed = {}
    for rank, rdir in others.items():
        if max(held.get(rank, ()), default=-1) >= protected or not writer.unheld(rdir):
            continue
        freed[rank] = sum(f.stat().st_size for f in rdir.iterdir() if f.is_file())
        shutil.rmtree(rdir, ignore_errors=True)
    if freed:
        events.emit("store_released", slot=slot, ranks=",".join(map(str, freed)), bytes=sum(freed.values()),
                    protected=protected, reason="ranks this node ran in another slot before, older than a step "
                    "protected since")
    return freed


def owned(complete: dict[int, dict[int, Held]], owner: Owner) -> dict[int, dict[int, Held]]:
    """The steps of `complete` whose every version is `owner`'s or adopted: what the agents may flush into this job's
    durable tier, where another job's versions would pass for its own."""
    return {s: held for s, held in complete.items()
            if all((who := stranger(h.manifest, owner)) is None or who.taken for h in held.values())}


def both(a: list[int], b: list[int]) -> list[int]:
    """The steps in both lists: the combine of an all-reduce of each agent's steps."""
    return sorted(set(a) & set(b))


def pin_targets(step: int, held: dict[int, Held]) -> list[tuple[Path, int]]:
    """(pin file, step) of the slot holding `step` in every rank's store (see `hpcft.store.pin`)."""
    return [(store_pin.path_of(h.manifest_path), step) for h in held.values()]


def _bad_chunk(data: np.ndarray, manifest: dict, throttle: Throttle | None = None) -> int | None:
    """The offset of the first chunk of `data` whose sealed crc32c is not its manifest's, or None."""
    key = seal_key(manifest)
    for off, n, crc in manifest["chunks"]:
        if throttle is not None:
            throttle.take(n)
        if seal(crc32c(data[off:off + n]), key) != crc:
            return off
    return None


def map_readonly(path: Path, nbytes: int) -> np.ndarray:
    if nbytes == 0:
        return np.empty(0, dtype=np.uint8)
    fd = open_file(path, os.O_RDONLY)  # StoreError, not a hang, if a FIFO or anything but our file sits there
    try:
        # MAP_POPULATE: map every page table entry now, in one call, instead of one fault per 4 KiB page later
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    return np.frombuffer(mm, dtype=np.uint8)


class Bundle:
    """The virtual concatenation of a node's parts for one step; `slices(lo, hi)` without copying."""

    def __init__(self, step: int, held: dict[int, Held]):
        self.step = step
        self.held = held
        ranks = sorted(held)
        header = json.dumps({"step": step, "ranks": [
            {"rank": r, "manifest_bytes": len(held[r].manifest_bytes),
             "data_bytes": int(held[r].manifest["data_bytes"])} for r in ranks]}, sort_keys=True).encode()
        self.parts: list[np.ndarray] = [np.frombuffer(_LEN.pack(len(header)) + header, dtype=np.uint8)]
        for r in ranks:
            h = held[r]
            self.parts.append(np.frombuffer(h.manifest_bytes, dtype=np.uint8))
            self.parts.append(map_readonly(h.data_path, int(h.manifest["data_bytes"])))
        self.starts = np.cumsum([0] + [p.size for p in self.parts]).tolist()
        self.size = self.starts[-1]

    def slices(self, lo: int, hi: int) -> Iterator[np.ndarray]:
        """Views covering bytes [lo, min(hi, size)) in order."""
        hi = min(hi, self.size)
        for part, start in zip(self.parts, self.starts):
            a, b = max(lo, start), min(hi, start + part.size)
            if a < b:
                yield part[a - start:b - start]

    def piece(self, lo: int, hi: int) -> list[np.ndarray]:
        """Bytes [lo, hi) as views, zero-padded past the end (the padding is the only allocation)."""
        views = list(self.slices(lo, hi))
        pad = hi - max(lo, min(hi, self.size))
        return views + ([np.zeros(pad, dtype=np.uint8)] if pad > 0 else [])

    def verify(self, throttle: Throttle | None = None) -> None:
        """Check every chunk of every rank's data against its manifest (paced by `throttle` when given);
        IntegrityError names the first bad one."""
        for i, (r, h) in enumerate(sorted(self.held.items())):
            off = _bad_chunk(self.parts[2 + 2 * i], h.manifest, throttle)
            if off is not None:
                events.emit("chunk_lost", level=logging.ERROR, rank=r, step=self.step, offset=off,
                            path=str(h.data_path))
                raise IntegrityError(f"rank {r} step {self.step}: chunk at offset {off} fails its crc32c")

    def pin_targets(self) -> list[tuple[Path, int]]:
        """(pin file, step) of every rank's slot holding this step: what the agent pins while it reads them."""
        return pin_targets(self.step, self.held)

    def still_committed(self) -> bool:
        """True if every rank's manifest of this step is still the one read (the slot was not reused)."""
        try:
            return all(h.manifest_path.read_bytes() == h.manifest_bytes for h in self.held.values())
        except OSError:
            return False

    def close(self) -> None:
        self.parts.clear()


@dataclass(frozen=True)
class Part:
    """One rank's share of a bundle received from elsewhere: its manifest (raw and parsed) and data bytes."""
    rank: int
    manifest_bytes: bytes
    manifest: dict
    data: np.ndarray


def parse(payload: np.ndarray, step: int) -> list[Part]:
    """A bundle's bytes split into its ranks' parts, every manifest and chunk crc32c verified; IntegrityError names
    the first mismatch (the bundle is then treated as lost)."""
    try:
        (hlen,) = _LEN.unpack(payload[:_LEN.size].tobytes())
        header = json.loads(payload[_LEN.size:_LEN.size + hlen].tobytes())
    except (struct.error, ValueError, RecursionError) as exc:
        raise IntegrityError(f"bundle of step {step}: unreadable header ({exc})") from exc
    problem = mismatch(header, _HEADER, "header")
    if problem is not None:
        raise IntegrityError(f"bundle of step {step}: {problem}")
    if header["step"] != step:
        raise IntegrityError(f"bundle holds step {header['step']}, expected step {step}")
    parts, off = [], _LEN.size + hlen
    for entry in header["ranks"]:
        mlen, dlen = entry["manifest_bytes"], entry["data_bytes"]
        raw = payload[off:off + mlen].tobytes()
        data = payload[off + mlen:off + mlen + dlen]
        off += mlen + dlen
        if data.size != dlen:
            raise IntegrityError(f"bundle of step {step} ends inside rank {entry['rank']}'s data")
        try:
            manifest = mf.decode(raw, f"<rank {entry['rank']} manifest in bundle>")
        except StoreError as exc:
            raise IntegrityError(str(exc)) from exc
        if manifest["step"] != step or manifest.get("rank", entry["rank"]) != entry["rank"]:
            raise IntegrityError(f"bundle of step {step}: rank {entry['rank']}'s manifest is for rank "
                                 f"{manifest.get('rank')} step {manifest['step']}")
        if (lo := _bad_chunk(data, manifest)) is not None:
            raise IntegrityError(f"bundle of step {step}: rank {entry['rank']} chunk at offset {lo} fails its crc32c")
        parts.append(Part(entry["rank"], raw, manifest, data))
    return parts


def unpack(parts: list[Part], job_id: str, root: str | os.PathLike | None = None) -> list[Path]:
    """Write verified parts into this node's rank stores: data into the slot the manifest names, then the manifest
    committed by the store's atomic rename (a torn unpack is never a version)."""
    from hpcft.store import RankStore  # the writer side of the store, used only on a replacement node

    written = []
    for part in parts:
        store = RankStore(job_id, part.rank, root=root)
        try:
            k = int(part.manifest["slot"])
            store.withdraw(k)
            slot = store.slot(k)
            slot.ensure(part.data.size)
            slot.array[:part.data.size] = part.data
            store.commit(slot, {k: v for k, v in part.manifest.items() if k not in ("checksum", "format")})
            written.append(slot.path)
        finally:
            store.close()
    return written
