"""Node-local, versioned snapshot store: shm slots, JSON manifests, checksums, atomic commit. Names are imported
lazily: the janitors and `hpcft run` need only the paths, and numpy and crc32c are half a janitor's start-up."""
from typing import Any

_LAZY = {
    "chunk_crc": "hpcft.store.checksum", "chunk_table": "hpcft.store.checksum", "crc32c": "hpcft.store.checksum",
    "seal": "hpcft.store.checksum", "seal_key": "hpcft.store.checksum",
    "ENV_ROOT": "hpcft.store.paths", "job_dir": "hpcft.store.paths", "resolve_root": "hpcft.store.paths",
    "secure_dir": "hpcft.store.paths",
    "Slot": "hpcft.store.slot",
    "RankStore": "hpcft.store.store", "Version": "hpcft.store.store", "rank_dir": "hpcft.store.paths",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hpcft.store' has no attribute {name!r}")
