"""The agent's policy for store pins (`hpcft.store.pin`): while it protects a step, or rebuilds a peer from it,
it pins that step's slot in every local rank's store, so the trainers write their next snapshots elsewhere
instead of overtaking the pass. One step pinned at a time (keep >= 2 then always leaves the trainers a slot);
a daemon thread renews the lease every third of it, so a pin outlives neither its agent nor a stopped one."""
from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from hpcft.errors import StoreError
from hpcft.store import pin as store_pin

_log = logging.getLogger(__name__)
LEASE_S = 30.0


class Pins:
    """The pins this agent holds (pin path → its current pin), renewed until released."""

    def __init__(self, owner: str, lease: float = LEASE_S):
        self.owner, self.lease = owner, lease
        self._held: dict[Path, store_pin.Pin] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="hpcft-pins", daemon=True)
        self._thread.start()

    @contextmanager
    def holding(self, targets: Iterable[tuple[Path, int]]) -> Iterator[None]:
        """Pin each (pin path, step) for the duration of the block; released (if still ours) afterwards."""
        targets = list(targets)
        try:
            with self._lock:
                for path, step in targets:
                    pin = store_pin.mine(step, self.lease, self.owner)
                    store_pin.write(path, pin)
                    self._held[path] = pin
            yield
        finally:
            with self._lock:
                for path, _ in targets:
                    pin = self._held.pop(path, None)
                    if pin is not None:
                        store_pin.remove(path, pin)

    def _renew(self) -> None:
        while not self._stop.wait(self.lease / 3):
            with self._lock:
                for path, old in list(self._held.items()):
                    if store_pin.read(path) != old:  # broken by the writer (we were stopped past the lease)
                        continue  # renewing would bind nothing: the slot's version has moved on or soon will
                    pin = store_pin.mine(old.step, self.lease, self.owner)
                    try:
                        store_pin.write(path, pin)
                        self._held[path] = pin
                    except StoreError as exc:
                        _log.warning("cannot renew pin %s: %s", path, exc)

    def close(self) -> None:
        """Stop renewing and release every pin still held."""
        self._stop.set()
        self._thread.join()
        with self._lock:
            for path, pin in self._held.items():
                store_pin.remove(path, pin)
            self._held.clear()
