"""crc32c arithmetic: the crc of a concatenation from the crcs of its parts (zlib's crc32_combine, for the
Castagnoli polynomial). The durable tier derives each chunk's checksum from the same sub-range checksums that
reproduce the store's, so the checksum it records is carried over from the store, not computed anew."""
from __future__ import annotations

import functools

_POLY = 0x82F63B78  # crc32c, reflected
_ONE = 1 << 31  # x^0 in the reflected representation


def _mult(a: int, b: int) -> int:
    """a * b modulo the polynomial (reflected)."""
    m, p = _ONE, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _powers() -> list[int]:
    out, p = [], 1 << 30  # x^1
    for _ in range(64):
        out.append(p)  # x^(2^k)
        p = _mult(p, p)
    return out


_X2N = _powers()


@functools.lru_cache(maxsize=4096)
def _shift(nbytes: int) -> int:
    """x^(8 * nbytes) modulo the polynomial."""
    p, k, n = _ONE, 3, nbytes
    while n:
        if n & 1:
            p = _mult(_X2N[k % 64], p)
        n >>= 1
        k += 1
    return p


def combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32c(A + B) from crc1 = crc32c(A), crc2 = crc32c(B) and len2 = len(B)."""
    return _mult(_shift(len2), crc1) ^ crc2
