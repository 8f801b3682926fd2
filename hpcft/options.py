"""`Options`: how a `hpcft.Checkpointer` snapshots and where it keeps and finds them, one documented field each.

Plain data (no torch import), checked once when made: `Checkpointer(model, optimizer, Options(every=2, keep=3))`.
"""
import os
from dataclasses import dataclass

from hpcft.errors import ConfigError

BACKENDS = ("auto", "cpu", "torch", "hip")


@dataclass(frozen=True)
class Options:
    """The Checkpointer's settings (docs/reference/checkpointing.md); each default is what a job under `hpcft run`
    wants."""

    every: int = 1
    """Snapshot every n-th optimizer step."""
    keep: int = 2
    """Complete versions kept in memory (the store has keep + 1 slots)."""
    auto: bool = True
    """Snapshot from the optimizer's post-step hook; with False, only at `ckpt.step(it)`."""
    root: str | os.PathLike | None = None
    """The store's root (None: $HPCFT_STORE_ROOT, else /dev/shm)."""
    job_id: str | None = None
    """The job whose store this is (None: the job environment's id)."""
    backend: str = "auto"
    """The copier: `auto` (hip on a ROCm GPU with hip-python, torch on another GPU, else cpu), `cpu`, `torch`, `hip`."""
    max_inflight_bytes: int = 256 << 20
    """GPU backends with host checksums: cap on bytes issued to the device but not yet landed and checksummed."""
    chunk_bytes: int | None = None
    """Unit of copy, checksum and loss (None: on the CPU the calibrated size, else the backend's own)."""
    threads: int | None = None
    """Copy / restore worker threads, given for both (None: the calibrated counts on the CPU, else 4)."""
    overlap: bool | None = None
    """CPU backend: copy while training goes on (None: where the process has more cores than torch's + the copy's)."""
    persist_dir: str | os.PathLike | None = None
    """The durable tier's directory, read by restore() (None: $HPCFT_PERSIST_DIR, which `hpcft run` exports)."""
    persist_local: str | os.PathLike | None = None
    """This node's durable level, read first (None: $HPCFT_PERSIST_LOCAL or $HPCFT_NVME/hpcft-persist; `none`: off)."""
    adopt: str | None = None
    """A job whose snapshots restore() takes besides its own; other jobs' are refused (None: $HPCFT_ADOPT)."""

    def __post_init__(self) -> None:
        for name in ("every", "keep", "max_inflight_bytes", "chunk_bytes", "threads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"Options.{name} must be a whole number of at least 1 (got {value!r})")
        if self.backend not in BACKENDS:
            raise ConfigError(f"Options.backend {self.backend!r} is unknown; choose one of {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "Options"]
