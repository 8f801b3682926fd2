"""The copy level's one interface: move chunks of state bytes into a store slot, checksum each chunk."""
from typing import Protocol, Sequence

import numpy as np
import torch

from hpcft.snapshot.plan import Chunk
from hpcft.store import Slot


class Transfer(Protocol):
    """One snapshot's copy in progress."""

    def done(self) -> bool:
        """True once every chunk is in host memory and checksummed."""

    def result(self, timeout: float | None = None) -> list[int]:
        """Block until done; the crc32c of each chunk in order; raises what the copy raised."""


class Copier(Protocol):
    """A backend (cpu, torch, hip). `start` is called on the training thread right after the optimizer
    step; `guard` right before the next one, and must make that step wait for the copy to finish
    (device-side where the device allows it)."""

    name: str
    chunk_bytes: int  # default checksum granularity for this backend (a Checkpointer may override it)
    overlap: bool  # False: `start` copies on the calling (training) thread and returns when the bytes are in
    checksums: str  # where chunk checksums are computed: "host" (as bytes land) or "device" (before they leave it)

    def start(self, sources: Sequence[torch.Tensor], chunks: Sequence[Chunk], slot: Slot) -> Transfer:
        """Begin copying: `sources` are flat uint8 views of the state, `chunks` say what goes where."""

    def guard(self, transfer: Transfer) -> None:
        """Order the next optimizer step after `transfer`'s reads of the state."""

    def close(self) -> None:
        """Stop workers and release pinned registrations."""


def crc_chunks(array: np.ndarray, chunks: Sequence[Chunk]) -> list[int]:
    """Checksums of `chunks` of a host array (used where the copy itself cannot fuse them)."""
    from hpcft.store import crc32c

    return [crc32c(array[c.offset:c.offset + c.nbytes]) for c in chunks]
