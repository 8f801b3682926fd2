"""Node-local, versioned snapshot store: shm slots, JSON manifests, checksums, atomic commit."""
from hpcft.store.checksum import chunk_table, crc32c, seal, seal_key
from hpcft.store.paths import ENV_ROOT, job_dir, resolve_root, secure_dir
from hpcft.store.slot import Slot
from hpcft.store.store import RankStore, Version, rank_dir

__all__ = ["ENV_ROOT", "RankStore", "Slot", "Version", "chunk_table", "crc32c", "job_dir", "rank_dir", "resolve_root",
           "seal", "seal_key", "secure_dir"]
