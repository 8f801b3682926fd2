"""Pins: a reader's claim on one committed version of a store slot (`slot-<k>.pin`), which the writer honours (picking
another slot) only while it names the slot's version, its lease runs and its owner lives, and breaks otherwise."""
from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from hpcft.errors import StoreError
from hpcft.store.paths import PIN, PINS, dirty, open_file, read_file, remove_file, replace_file


@dataclass(frozen=True)
class Pin:
    """`step` of the slot held by process `pid` (started at `start`, /proc ticks) on `host` until wall time `until`;
    `owner`: a label for people (e.g. `agent slot 2`)."""
    step: int
    host: str
    pid: int
    start: int
    until: float
    owner: str = ""


def path_of(manifest_path: Path) -> Path:
    """The pin file of the slot whose manifest is `manifest_path` (`slot-<k>.json` → `slot-<k>.pin`)."""
    return manifest_path.with_suffix(f".{PIN}")


def process_start(pid: int) -> int | None:
    """Process `pid`'s start in clock ticks since boot (None: no such process): with the pid, one process for good."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def mine(step: int, lease: float, owner: str = "") -> Pin:
    """A pin of `step` by this process for `lease` seconds from now."""
    pid = os.getpid()
    return Pin(step, socket.gethostname(), pid, process_start(pid) or 0, time.time() + lease, owner)


def write(path: Path, pin: Pin) -> None:
    """Create or renew `path` atomically (a `.dirty` file of this process, 0600, renamed over it)."""
    try:
        replace_file(path, json.dumps(asdict(pin), sort_keys=True).encode(), dirty(path, os.getpid()))
    except OSError as exc:
        raise StoreError(f"cannot pin {path}: {exc.strerror or exc}") from exc


def read(path: Path) -> Pin | None:
    """The pin at `path`, or None if there is none; an unreadable pin file reads as one already expired."""
    if not os.path.lexists(path):
        return None
    try:
        fields = json.loads(read_file(path))
        return Pin(int(fields["step"]), str(fields["host"]), int(fields["pid"]), int(fields["start"]),
                   float(fields["until"]), str(fields.get("owner", "")))
    except (StoreError, ValueError, KeyError, TypeError):  # StoreError: a symlink, FIFO, another user's file...
        return Pin(-1, "", 0, 0, 0.0, "unreadable")


def remove(path: Path, pin: Pin | None = None) -> None:
    """Remove `path`; with `pin`, only if the file still holds that pin (a renewal by its owner is not undone)."""
    if pin is not None and read(path) != pin:
        return
    remove_file(path)


def stale_reason(pin: Pin, now: float | None = None) -> str | None:
    """Why `pin` no longer binds anyone (its lease ran out, its owner on this host is gone), or None if it does."""
    now = time.time() if now is None else now
    if pin.until <= now:
        return f"lease expired {now - pin.until:.1f} s ago"
    if pin.host == socket.gethostname() and process_start(pin.pid) != pin.start:
        return f"owner pid {pin.pid} is gone"
    return None


def announce(job: Path) -> None:
    """Tell the job's writers that a reader pins here: stores opened afterwards keep a spare slot, so a pass in flight
    and the newest protected version can both be pinned without leaving a writer no slot."""
    path = job / PINS
    if not path.exists():
        os.close(open_file(path, os.O_WRONLY, create=True))


def announced(job: Path) -> bool:
    """True if a reader announced pins for this job (see `announce`)."""
    return (job / PINS).exists()
