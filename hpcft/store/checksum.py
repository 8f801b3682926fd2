"""crc32c of byte ranges (hardware accelerated, releases the GIL on large buffers)."""
from typing import Any

from hpcft.deps import require

_crc = require("crc32c", "snapshot checksums").crc32c


def crc32c(buf: Any, crc: int = 0) -> int:
    """crc32c of a bytes-like object (numpy array, memoryview, bytes); `crc` continues a running checksum
    (crc32c(b, crc32c(a)) == crc32c(a + b))."""
    return _crc(buf if isinstance(buf, (bytes, bytearray)) else memoryview(buf).cast("B"), crc)
