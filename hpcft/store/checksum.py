"""crc32c of byte ranges (hardware accelerated, releases the GIL on large buffers)."""
from typing import Any

from hpcft.deps import require

_crc = require("crc32c", "snapshot checksums").crc32c


def crc32c(buf: Any) -> int:
    """crc32c of a bytes-like object (numpy array, memoryview, bytes)."""
    return _crc(memoryview(buf).cast("B")) if not isinstance(buf, (bytes, bytearray)) else _crc(buf)
