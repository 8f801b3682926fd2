"""The copy level's one interface: move chunks of state bytes into a store slot, checksum each chunk."""
import threading
from typing import Callable, Protocol, Sequence

import numpy as np
import torch

from hpcft.errors import StoreError
from hpcft.snapshot.plan import Chunk
from hpcft.store import Slot


class SlotUnavailable(StoreError):
    """No slot could be taken for a snapshot (every reusable one pinned, no space, ...): it is skipped."""


class SlotClaim:
    """The slot a snapshot writes, taken (`RankStore.begin`) once by whoever writes first: a GPU copier's issuing
    thread, so the training thread spends no file operations at the boundary; the old version is withdrawn right
    before its bytes are overwritten either way."""

    def __init__(self, take: Callable[[], Slot]):
        self._take = take
        self._lock = threading.Lock()
        self.slot: Slot | None = None

    def __call__(self) -> Slot:
        """The slot, taken now if it was not yet; SlotUnavailable if none can be."""
        with self._lock:
            if self.slot is None:
                try:
                    self.slot = self._take()
                except SlotUnavailable:
                    raise
                except StoreError as exc:
                    raise SlotUnavailable(str(exc)) from exc
            return self.slot


class Transfer(Protocol):
    """One snapshot's copy in progress."""

    def result(self, timeout: float | None = None) -> list[int]:
        """Block until done; the crc32c of each chunk in order; raises what the copy raised."""


class Copier(Protocol):
    """A backend (cpu, torch, hip). `start` runs on the training thread right after the optimizer step; `guard`
    right before the next one, and makes that step wait for the copy (device-side where it can)."""

    name: str
    chunk_bytes: int  # default checksum granularity for this backend (a Checkpointer may override it)
    overlap: bool  # False: `start` copies on the calling (training) thread and returns when the bytes are in
    checksums: str  # where chunk checksums are computed: "host" (as bytes land) or "device" (before they leave it)

    def start(self, sources: Sequence[torch.Tensor], chunks: Sequence[Chunk], claim: SlotClaim) -> Transfer:
        """Begin copying: `sources` are flat uint8 views of the state, `chunks` say what goes where, into the slot
        `claim` takes (SlotUnavailable from `start` or from the transfer's result: the snapshot is skipped)."""

    def guard(self, transfer: Transfer) -> None:
        """Order the next optimizer step after `transfer`'s reads of the state."""

    def close(self) -> None:
        """Stop workers and release pinned registrations."""


def crc_chunks(array: np.ndarray, chunks: Sequence[Chunk]) -> list[int]:
    """Checksums of `chunks` of a host array (used where the copy itself cannot fuse them)."""
    from hpcft.store import crc32c

    return [crc32c(array[c.offset:c.offset + c.nbytes]) for c in chunks]
