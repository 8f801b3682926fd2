"""A rank's versioned snapshots: fixed slots reused round-robin, a manifest per complete version."""
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcft import events
from hpcft.errors import StoreError
from hpcft.store import manifest as mf
from hpcft.store import pin as pins
from hpcft.store.paths import job_dir, mark_run, resolve_root, secure_dir
from hpcft.store.slot import Slot

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Version:
    """A complete snapshot held by this rank: its step, the slot that holds it and its manifest."""
    step: int
    slot: int
    manifest: dict[str, Any]


def rank_dir(job: Path, rank: int) -> Path:
    return job / f"rank-{rank:05d}"


class RankStore:
    """Slots `slot-<k>.data` + manifests `slot-<k>.json` under `<root>/hpcft-<user>-<job>/rank-<r>/`.

    Invariants: a slot is written only after its manifest is withdrawn; the slot holding the newest
    complete version is never chosen for writing; a crash at any point leaves that version loadable; a slot
    whose version a live reader has pinned (`slot-<k>.pin`, see `hpcft.store.pin`) is not chosen either.

    `readonly=True` is for other processes (the node agent): nothing is created or cleaned, slots are
    mapped read-only. The writer may withdraw and reuse an unpinned slot at any time, so a reader pins the
    version (pin first, then check that the manifest is still the one it read: the writer withdraws first, then
    checks the pin), or copies the data, verifies the chunk checksums and checks the manifest afterwards.
    """

    def __init__(self, job_id: str, rank: int, *, keep: int = 2, root: str | os.PathLike | None = None,
                 user: str | None = None, readonly: bool = False):
        if keep < 1:
            raise StoreError(f"keep must be at least 1 (got {keep})")
        self.keep = keep
        self.rank = rank
        self.readonly = readonly
        self.job = secure_dir(job_dir(resolve_root(root), job_id, user), create=not readonly)
        self.dir = secure_dir(rank_dir(self.job, rank), create=not readonly)
        self.nslots = keep + 1 + (1 if pins.announced(self.job) else 0)  # a spare slot where an agent pins
        self._slots: dict[int, Slot] = {}
        self._full: set[int] = set()  # slots whose allocation ran out of space in this process
        self._index: dict[int, Version] | None = None  # slot -> complete version, as this writer knows it
        if not readonly:
            mark_run(self.job)  # for slurm/epilog.sh: which Slurm run's snapshots these are
            for stale in self.dir.glob("*.dirty"):
                stale.unlink(missing_ok=True)

    def _manifest_path(self, k: int) -> Path:
        return self.dir / f"slot-{k}.json"

    def slot(self, k: int) -> Slot:
        """Open (create if missing) slot k."""
        if k not in self._slots:
            self._slots[k] = Slot(k, self.dir / f"slot-{k}.data", readonly=self.readonly)
        return self._slots[k]

    def versions(self) -> list[Version]:
        """Complete versions held here, oldest first, read from disk (an unreadable manifest is reported
        and skipped). Also refreshes the writer's in-memory index."""
        found = {}
        for k in range(self.nslots):
            path = self._manifest_path(k)
            if not path.exists():
                continue
            try:
                m = mf.read(path)
            except StoreError as exc:
                events.emit("manifest_bad", level=logging.WARNING, rank=self.rank, path=str(path), error=str(exc))
                continue
            found[k] = Version(int(m["step"]), k, m)
        self._index = found
        return sorted(found.values(), key=lambda v: v.step)

    def _held(self) -> list[Version]:
        """The writer's view without touching the disk (only this process writes this rank's manifests)."""
        if self._index is None:
            return self.versions()
        return sorted(self._index.values(), key=lambda v: v.step)

    def begin(self, nbytes: int) -> Slot:
        """Pick a slot for a new version of `nbytes`, withdraw its manifest, size it; StoreError if none fits or
        every reusable slot is pinned (event `slots_pinned`: this snapshot is skipped, training goes on)."""
        held = self._held()
        newest = held[-1].slot if held else None
        by_age = {v.slot: i for i, v in enumerate(held)}
        order = sorted((k for k in range(self.nslots) if k != newest), key=lambda k: by_age.get(k, -1))
        last_error: StoreError | None = None
        pinned: dict[int, pins.Pin] = {}
        for k in order:
            if k in self._full and (k not in self._slots or self._slots[k].size < nbytes):
                continue
            version = self._index.get(k) if self._index is not None else None
            if self._pinned(k, version, pinned):
                continue
            self.withdraw(k)
            if self._pinned(k, version, pinned):  # pinned between the check and the withdrawal: put it back
                self.commit(self.slot(k), version.manifest)
                continue
            try:
                slot = self.slot(k)
                slot.ensure(nbytes)
                return slot
            except StoreError as exc:
                self._full.add(k)
                last_error = exc
                events.emit("store_full", level=logging.ERROR, rank=self.rank, slot=k, bytes=nbytes, error=str(exc))
        if pinned and last_error is None:
            who = ", ".join(f"slot {k} step {p.step} by {p.owner or 'pid'} {p.pid}@{p.host}" for k, p in pinned.items())
            events.emit("slots_pinned", level=logging.WARNING, rank=self.rank, slots=",".join(map(str, pinned)),
                        pins=who)
            raise StoreError(f"every reusable slot of rank {self.rank} is pinned by a reader ({who}); this snapshot "
                             "is skipped and the next one tries again")
        raise last_error or StoreError(f"no slot available in {self.dir}")

    def _pinned(self, k: int, version: Version | None, found: dict[int, "pins.Pin"]) -> bool:
        """True if a live pin holds the version slot k holds (recorded in `found`); a pin whose lease ran out or
        whose owner died is broken here, with an event. A pin of another step than the slot's binds nothing."""
        path = pins.path_of(self._manifest_path(k))
        pin = pins.read(path)
        if pin is None or version is None:
            return False
        reason = pins.stale_reason(pin)
        if reason is not None:
            pins.remove(path, pin)
            events.emit("pin_broken", level=logging.WARNING, rank=self.rank, slot=k, step=pin.step, owner=pin.owner,
                        pid=pin.pid, host=pin.host, reason=reason)
            return False
        if pin.step != version.step:
            return False
        found[k] = pin
        return True

    def preallocate(self, nbytes: int) -> None:
        """Size and pre-fault every slot now (fresh shm pages cost ~10x warm ones), so that later snapshots
        only ever write warm pages. A slot that does not fit is reported and left for `begin` to skip."""
        for k in range(self.nslots):
            if k in self._full:
                continue
            try:
                self.slot(k).ensure(nbytes)
                self.slot(k).prefault()
            except StoreError as exc:
                self._full.add(k)
                events.emit("store_full", level=logging.ERROR, rank=self.rank, slot=k, bytes=nbytes, error=str(exc))

    def withdraw(self, k: int) -> None:
        """Remove slot k's manifest: from now on its data is not a version and may be overwritten."""
        self._manifest_path(k).unlink(missing_ok=True)
        if self._index is not None:
            self._index.pop(k, None)

    def commit(self, slot: Slot, manifest: dict[str, Any]) -> None:
        """Publish `slot` as a complete version described by `manifest` (atomic rename)."""
        manifest = {**manifest, "slot": slot.index}
        mf.write_atomic(self._manifest_path(slot.index), manifest)
        if self._index is not None:
            self._index[slot.index] = Version(int(manifest["step"]), slot.index, manifest)

    def close(self) -> None:
        """Unmap every slot; the snapshots stay on the store root."""
        for slot in self._slots.values():
            slot.close()
        self._slots.clear()
