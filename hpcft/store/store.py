"""A rank's versioned snapshots: fixed slots reused round-robin, a manifest per complete version."""
import logging
import os
import weakref
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from hpcft import events
from hpcft.errors import StoreError, StoreFullError
from hpcft.store import manifest as mf, pin as pins, writer
from hpcft.store.paths import (DATA, DIRTY, dirty, job_dir, mark_run, rank_dir, remove_file, resolve_root, secure_dir,
                               slot_file, slot_files)
from hpcft.store.slot import GRAIN, Slot


@dataclass(frozen=True)
class Version:
    """A complete snapshot held by this rank: its step, the slot that holds it and its manifest."""
    step: int
    slot: int
    manifest: dict[str, Any]


def _age(v: Version) -> tuple[int, float]:
    """Versions in the order they were written: by step, then (two of one step, left by older code) by time."""
    t = v.manifest.get("time")
    return v.step, float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else 0.0


class RankStore:
    """Slots `slot-<k>.data` + manifests `slot-<k>.json` under `<root>/hpcft-<user>-<job>/rank-<r>/`. A slot is
    written only after its manifest is withdrawn; neither the newest complete version's slot nor a live reader's
    pinned one is chosen for writing, so a crash at any point leaves that version loadable. A reader (`readonly`:
    nothing created or cleaned) pins a version, then checks its manifest is still the one it read (the writer
    withdraws, then checks the pin), or copies the data and checks checksums and manifest afterwards."""

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
        self._full: set[int] = set()  # slots whose allocation ran out of space (retried once the space is back)
        self._refused: dict[int, str] = {}  # slots skipped for an unusable file, with the reason (reported once)
        self._index: dict[int, Version] | None = None  # slot -> complete version, as this writer knows it
        self._manifests = mf.ReadCache()  # what `versions()` parsed, reused while a manifest file is unchanged
        self.rejected: list[str] = []  # manifests the last `versions()` skipped, and why
        self._release = weakref.finalize(self, lambda: None)
        if not readonly:
            self._release = weakref.finalize(self, writer.claim(self.dir))  # released on close, or when dropped
            try:
                mark_run(self.job)  # for slurm/epilog.sh: which Slurm run's snapshots these are
            except StoreError as exc:  # e.g. a full store: restoring what it holds needs no write
                self._event("run_marker_failed", level=logging.WARNING, path=str(self.job), error=str(exc))
            for stale in self.dir.glob(f"*{DIRTY}"):
                try:
                    remove_file(stale)
                except StoreError as exc:
                    self._event("store_file_refused", path=str(stale), error=str(exc))

    def _event(self, kind: str, level: int = logging.ERROR, **fields) -> None:
        events.emit(kind, level=level, rank=self.rank, **fields)

    def versions(self) -> list[Version]:
        """Complete versions held here, oldest first, read from disk (bad manifests reported as `manifest_bad` and
        listed in `rejected`), whatever this store's `keep`; refreshes the writer's in-memory index."""
        found, self.rejected = {}, []
        try:
            manifests = slot_files(self.dir)
        except OSError as exc:  # nothing here can be read: no version (the same outcome on every rank)
            manifests, self.rejected = {}, [f"cannot list {self.dir}: {exc.strerror or exc}"]
            self._event("manifest_bad", level=logging.WARNING, path=str(self.dir), error=self.rejected[0])
        for k, path in sorted(manifests.items()):
            try:
                m = self._manifests.read(path)
                found[k] = Version(mf.check_own(m, k, self.rank, path), k, m)
            except StoreError as exc:
                self.rejected.append(str(exc))
                self._event("manifest_bad", level=logging.WARNING, path=str(path), error=str(exc))
        self._manifests.keep({manifests[k] for k in found})
        self._index = found
        return sorted(found.values(), key=_age)

    def _held(self) -> list[Version]:
        """The writer's view without touching the disk (only this process writes this rank's manifests)."""
        if self._index is None:
            return self.versions()
        return sorted(self._index.values(), key=_age)

    def begin(self, nbytes: int) -> Slot:
        """A slot for a new version of `nbytes`, its manifest withdrawn; StoreError if none fits or every reusable
        one is pinned (event `slots_pinned`: this snapshot is skipped, training goes on)."""
        held = self._held()
        newest = held[-1].slot if held else None
        by_age = {v.slot: i for i, v in enumerate(held)}
        order = sorted((k for k in range(self.nslots) if k != newest), key=lambda k: by_age.get(k, -1))
        last_error: StoreError | None = None
        pinned: dict[int, pins.Pin] = {}
        for k in order:
            if k in self._full and not self._room_for(k, nbytes):
                continue
            version = self._index.get(k) if self._index is not None else None
            if self._pinned(k, version, pinned):
                continue
            try:
                self.withdraw(k)
                remove_file(dirty(slot_file(self.dir, k)))  # where its commit writes
            except StoreError as exc:  # e.g. a directory where its manifest goes
                self._refuse(k, exc)
                last_error = exc
                continue
            if self._pinned(k, version, pinned):  # pinned between the check and the withdrawal: put it back
                self.commit(self.slot(k), version.manifest)
                continue
            try:
                self._allocate(k, nbytes)
                return self._slots[k]
            except StoreError as exc:
                last_error = exc
        if pinned and last_error is None:
            who = ", ".join(f"slot {k} step {p.step} by {p.owner or 'pid'} {p.pid}@{p.host}" for k, p in pinned.items())
            events.emit("slots_pinned", level=logging.WARNING, rank=self.rank, slots=",".join(map(str, pinned)),
                        pins=who)
            raise StoreError(f"every reusable slot of rank {self.rank} is pinned by a reader ({who}); this snapshot "
                             "is skipped and the next one tries again")
        raise last_error or StoreError(f"no slot available in {self.dir}")

    def _pinned(self, k: int, version: Version | None, found: dict[int, "pins.Pin"]) -> bool:
        """True if a live pin holds slot k's version (recorded in `found`); a stale pin is broken here with an event,
        a pin of another step binds nothing."""
        path = pins.path_of(slot_file(self.dir, k))
        pin = pins.read(path)
        if pin is None or version is None:
            return False
        reason = pins.stale_reason(pin)
        if reason is not None:
            try:
                pins.remove(path, pin)
            except StoreError as exc:  # e.g. a directory where the pin goes: it binds nobody, and stays
                self._refuse(k, exc)
                return False
            events.emit("pin_broken", level=logging.WARNING, rank=self.rank, slot=k, step=pin.step, owner=pin.owner,
                        pid=pin.pid, host=pin.host, reason=reason)
            return False
        if pin.step != version.step:
            return False
        found[k] = pin
        return True

    def preallocate(self, nbytes: int) -> None:
        """Size and pre-fault every slot now (fresh shm pages cost ~10x warm ones), so snapshots write warm pages; a
        slot that does not fit is reported and left for `begin` to skip."""
        for k in range(self.nslots):
            if k in self._full and not self._room_for(k, nbytes):
                continue
            with suppress(StoreError):  # reported by _allocate; `begin` skips the slot
                self._allocate(k, nbytes)
                self._slots[k].prefault()

    def _allocate(self, k: int, nbytes: int) -> None:
        """Open slot k and make it `nbytes` long; StoreError with an event: `store_full` (retried once there is room,
        `store_resumed`) or `store_file_refused` (an unusable file: retried each time, reported once)."""
        try:
            slot = self.slot(k)
            slot.ensure(nbytes)
        except StoreFullError as exc:
            self._full.add(k)
            self._event("store_full", slot=k, bytes=nbytes, error=str(exc))
            raise
        except StoreError as exc:
            self._refuse(k, exc)
            raise
        if k in self._full or k in self._refused:
            self._full.discard(k)
            self._refused.pop(k, None)
            self._event("store_resumed", level=logging.WARNING, slot=k, bytes=nbytes)

    def _refuse(self, k: int, exc: StoreError) -> None:
        """Report (once per reason) that slot k is skipped because one of its files is unusable."""
        if self._refused.get(k) != str(exc):
            self._refused[k] = str(exc)
            self._event("store_file_refused", slot=k, path=str(self.dir), error=str(exc))

    def _room_for(self, k: int, nbytes: int) -> bool:
        """True if slot k already holds `nbytes` or the file system now has the space it lacks (statvfs)."""
        have = self._slots[k].size if k in self._slots else 0
        if have >= nbytes:
            return True
        try:
            st = os.statvfs(self.dir)
        except OSError:
            return False
        return st.f_bavail * st.f_frsize >= -(-(nbytes - have) // GRAIN) * GRAIN

    def withdraw(self, k: int) -> None:
        """Remove slot k's manifest: from now on its data is not a version and may be overwritten."""
        remove_file(slot_file(self.dir, k))
        if self._index is not None:
            self._index.pop(k, None)

    def slot(self, k: int, *, create: bool = True) -> Slot:
        """Open slot k (with `create`, create its file if missing: a restore opens only what exists)."""
        if k not in self._slots:
            self._slots[k] = Slot(k, slot_file(self.dir, k, DATA), readonly=self.readonly, create=create)
        return self._slots[k]

    def commit(self, slot: Slot, manifest: dict[str, Any]) -> None:
        """Publish `slot` as a complete version described by `manifest` (atomic rename); another slot of the same step
        (left by a timeline a restore went back from) is withdrawn: one version per step."""
        manifest = {**manifest, "slot": slot.index, "rank": self.rank}
        mf.write_atomic(slot_file(self.dir, slot.index), manifest)
        step = int(manifest["step"])
        if self._index is not None:
            self._index[slot.index] = Version(step, slot.index, manifest)
            for v in [v for v in self._index.values() if v.step == step and v.slot != slot.index]:
                self.retire(v, "superseded by a newer version of the same step")
            self._prune()

    def retire(self, version: Version, reason: str) -> None:
        """Withdraw `version` for good (event `version_withdrawn`): one restore fell back past, or a newer write of its
        step superseded, must never be picked again. A pinned one is left to its reader."""
        if self._pinned(version.slot, version, {}):
            return
        try:
            self.withdraw(version.slot)
        except StoreError as exc:
            self._event("store_file_refused", slot=version.slot, error=str(exc))
            return
        self._event("version_withdrawn", level=logging.WARNING, step=version.step, slot=version.slot, reason=reason)

    def _prune(self) -> None:
        """Free the slots beyond `nslots` (left by a run with a larger `keep`) once `keep` newer versions exist."""
        held = self._held()
        newest = held[-self.keep:]
        for v in held:
            if v.slot >= self.nslots and v not in newest and not self._pinned(v.slot, v, {}):
                try:
                    self.withdraw(v.slot)
                    if v.slot in self._slots:
                        self._slots.pop(v.slot).close()
                    remove_file(slot_file(self.dir, v.slot, DATA))
                except StoreError as exc:
                    self._event("store_file_refused", slot=v.slot, error=str(exc))

    def close(self) -> None:
        """Unmap every slot and release the writer lock; the snapshots stay on the store root."""
        for slot in self._slots.values():
            slot.close()
        self._slots.clear()
        self._release()
