"""The agent's store pins: the step a pass or a rebuild reads, so the trainers write elsewhere, and the newest protected
step until a newer one is, so a node loss always finds it on the survivors; two per rank at most (the store's spare
slot leaves the trainers one). Renewed every third of a lease: a pin outlives neither its agent nor a stopped one."""
from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from hpcft.agent.transport.throttle import chore
from hpcft.errors import StoreError
from hpcft.store import pin as store_pin

_log = logging.getLogger(__name__)
LEASE_S = 30.0


class Pins:
    """The pins this agent holds (pin path → its current pin), renewed until released."""

    def __init__(self, owner: str, lease: float = LEASE_S):
        self.owner, self.lease = owner, lease
        self._held: dict[Path, store_pin.Pin] = {}
        self._passes: list[Path] = []  # held for a pass in progress (one entry per holding, per slot)
        self._kept: set[Path] = set()  # held as the newest protected step
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = chore(self._renew, name="hpcft-pins")
        self._thread.start()

    @contextmanager
    def holding(self, targets: Iterable[tuple[Path, int]]) -> Iterator[None]:
        """Pin each (pin path, step) for the duration of the block; released afterwards unless kept."""
        targets = list(targets)
        try:
            with self._lock:
                for path, step in targets:
                    self._passes.append(path)
                    self._pin(path, step)
            yield
        finally:
            with self._lock:
                for path, _ in targets:
                    self._passes.remove(path)
                self._release_unneeded([path for path, _ in targets])

    def keep(self, targets: Iterable[tuple[Path, int]]) -> None:
        """Keep these (pin path, step) pinned as the newest protected step, releasing the previous one."""
        targets = list(targets)
        with self._lock:
            old, self._kept = self._kept, {path for path, _ in targets}
            for path, step in targets:
                if path not in self._held or self._held[path].step != step:
                    self._pin(path, step)
            self._release_unneeded(old - self._kept)

    def _pin(self, path: Path, step: int) -> None:
        pin = store_pin.mine(step, self.lease, self.owner)
        store_pin.write(path, pin)
        self._held[path] = pin

    def _release_unneeded(self, paths: Iterable[Path]) -> None:
        for path in paths:
            if path not in self._passes and path not in self._kept and path in self._held:
                store_pin.remove(path, self._held.pop(path))

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
