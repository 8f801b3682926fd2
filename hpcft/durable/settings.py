"""The durable tier's settings, shared by the launcher (which passes them on) and the node agents (which flush)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PersistConfig:
    """Where and how often the agents flush (see `python -m hpcft.agent --help`)."""
    root: str | None = None  # the persist directory; None: no flushing
    every: int = 100  # flush once the newest protected step is this many steps past the newest durable one
    keep: int = 2  # complete durable checkpoints kept
    rate: float | None = None  # bytes/s cap on one node's flush writes
    sync: bool = True  # fsync what is written (off only for benches of the page cache)
    local: str | None = None  # the node-local first level (hpcft.durable.local.local_root: None from the environment)
