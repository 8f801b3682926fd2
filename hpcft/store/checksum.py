"""crc32c of byte ranges (hardware accelerated, releases the GIL on large buffers)."""
import json
from collections.abc import Callable
from typing import Any

from hpcft.deps import require

_crc = require("crc32c", "snapshot checksums").crc32c


def crc32c(buf: Any, crc: int = 0) -> int:
    """crc32c of a bytes-like object (numpy array, memoryview, bytes); `crc` continues a running checksum
    (crc32c(b, crc32c(a)) == crc32c(a + b))."""
    return _crc(buf if isinstance(buf, (bytes, bytearray)) else memoryview(buf).cast("B"), crc)


def chunk_crc(chunk: Any, padding: Callable[[int, int, int], int], segment: Callable[[Any, int], int]) -> int:
    """crc32c of one chunk's bytes in its slot (a plan.Chunk), in order: each segment through `segment(s, crc)`, which
    copies it too (into or out of the slot), the padding between and after them through `padding(lo, hi, crc)`."""
    crc, pos = 0, chunk.offset
    for s in chunk.segments:
        if s.offset > pos:
            crc = padding(pos, s.offset, crc)
        crc = segment(s, crc)
        pos = s.offset + s.nbytes
    end = chunk.offset + chunk.nbytes
    return padding(pos, end, crc) if pos < end else crc


SEALED = ("step", "rng", "optim", "extra")  # what a snapshot restores besides its tensors


def seal_key(manifest: dict[str, Any]) -> int:
    """crc32c of the manifest's step, RNG state, optimizer settings and `extra` (canonical JSON): what restore applies
    besides the tensors' bytes, which nothing else checks."""
    text = json.dumps([manifest.get(k) for k in SEALED], sort_keys=True, separators=(",", ":"))
    return crc32c(text.encode())


def seal(crc: int, key: int) -> int:
    """A chunk's recorded checksum: its crc32c continued over its manifest's `seal_key`, so a manifest whose sealed
    fields were edited (its own checksum recomputed) no longer matches its data."""
    return crc32c(key.to_bytes(4, "little"), crc)


def chunk_table(data: Any, chunk_bytes: int, key: int) -> list[list[int]]:
    """A manifest's `chunks` ([offset, nbytes, crc32c sealed with `key`]) for plain bytes `data` cut every
    `chunk_bytes` (for the protect bench and tests, which write no snapshot through the engine)."""
    n = len(data)
    return [[lo, min(chunk_bytes, n - lo), seal(crc32c(data[lo:lo + chunk_bytes]), key)]
            for lo in range(0, n, chunk_bytes)]
