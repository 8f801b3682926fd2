"""crc32c of byte ranges (hardware accelerated, releases the GIL on large buffers)."""
from typing import Any

from hpcft.deps import require

_crc = require("crc32c", "snapshot checksums").crc32c


def crc32c(buf: Any, crc: int = 0) -> int:
    """crc32c of a bytes-like object (numpy array, memoryview, bytes); `crc` continues a running checksum
    (crc32c(b, crc32c(a)) == crc32c(a + b))."""
    return _crc(buf if isinstance(buf, (bytes, bytearray)) else memoryview(buf).cast("B"), crc)


def seal(crc: int, step: int) -> int:
    """A chunk's recorded checksum: its crc32c continued over the step (8 bytes, little-endian), so that a manifest
    whose step was changed no longer matches its data (a step is bound to the bytes it describes)."""
    return crc32c(step.to_bytes(8, "little", signed=True), crc)


def chunk_table(data: Any, chunk_bytes: int, step: int) -> list[list[int]]:
    """A manifest's `chunks` for raw bytes `data` cut every `chunk_bytes`: `[offset, nbytes, sealed crc32c]` (for
    writers that hold plain bytes, such as the protect bench and tests, rather than a snapshot engine)."""
    n = len(data)
    return [[lo, min(chunk_bytes, n - lo), seal(crc32c(data[lo:lo + chunk_bytes]), step)]
            for lo in range(0, n, chunk_bytes)]
