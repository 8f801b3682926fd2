"""crc32c arithmetic over GF(2), so that a checksum assembled from checksums of its parts computed anywhere (a GPU
kernel, the durable tier's sub-ranges) equals what `crc32c` gives. With no initial value and no final xor (the *raw*
crc), crc32c is linear: raw(a ‖ b) = A^|b|(raw(a)) ⊕ raw(b), where A^n, "n zero bytes more", multiplies by x^(8n)
modulo the polynomial; leading zero bytes leave a raw crc unchanged; crc32c(m) = raw(m) ⊕ A^|m|(0xFFFFFFFF) ⊕
0xFFFFFFFF; crc32c(a ‖ b) = A^|b|(crc32c(a)) ⊕ crc32c(b) (zlib's crc32_combine). An operator held as its 32 columns
(uint32: the image of bit j) is applied through four 256-entry tables (`tables`), as a GPU kernel does, or to whole
arrays (`shift`)."""
from __future__ import annotations

import functools

import numpy as np

POLY = 0x82F63B78  # crc32c (Castagnoli), bit-reflected
ONE = 1 << 31  # x^0 in the reflected representation
ONES = 0xFFFFFFFF
U32 = np.uint32


def multiply(a: int, b: int) -> int:
    """a · b modulo the polynomial (reflected)."""
    m, p = ONE, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ POLY if b & 1 else b >> 1


def _powers() -> list[int]:
    out, p = [], 1 << 30  # x^1
    for _ in range(64):
        out.append(p)  # x^(2^k)
        p = multiply(p, p)
    return out


_X2N = _powers()


@functools.lru_cache(maxsize=4096)
def x8n(nbytes: int) -> int:
    """x^(8 · nbytes) modulo the polynomial: what `nbytes` zero bytes more multiply a crc by."""
    p, k, n = ONE, 3, nbytes
    while n:
        if n & 1:
            p = multiply(_X2N[k % 64], p)
        n >>= 1
        k += 1
    return p


def combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32c(A + B) from crc1 = crc32c(A), crc2 = crc32c(B) and len2 = len(B)."""
    return multiply(x8n(len2), crc1) ^ crc2


def _byte_table() -> np.ndarray:
    t = np.arange(256, dtype=np.uint64)
    for _ in range(8):
        t = np.where(t & 1, (t >> 1) ^ POLY, t >> 1)
    return t.astype(U32)


BYTE_TABLE = _byte_table()


@functools.lru_cache(maxsize=64)
def zeros(nbytes: int) -> np.ndarray:
    """The operator A^nbytes as its 32 columns."""
    c = x8n(nbytes)
    out = np.array([multiply(c, 1 << j) for j in range(32)], dtype=U32)
    out.setflags(write=False)
    return out


def apply(op: np.ndarray, v: "int | np.ndarray") -> "int | np.ndarray":
    """op(v) for an operator given by its columns: the xor of the columns of v's set bits (v: int or uint32 array)."""
    arr = np.asarray(v, dtype=U32)
    bits = (arr[..., None] >> np.arange(32, dtype=U32)) & U32(1)
    out = np.bitwise_xor.reduce(np.where(bits.astype(bool), op, U32(0)), axis=-1).astype(U32)
    return int(out) if np.ndim(v) == 0 else out


def tables(op: np.ndarray) -> np.ndarray:
    """uint32[4, 256]: table k maps byte value i to op(i << 8k), so op(v) = ⊕_k tables[k][byte k of v]."""
    i = np.arange(256, dtype=U32)
    return np.stack([apply(op, i << U32(8 * k)) for k in range(4)])


@functools.lru_cache(maxsize=None)
def log_tables(bits: int = 40) -> np.ndarray:
    """uint32[bits, 4, 256]: the tables of A^(2^b), b < bits: A^n of any n < 2^bits is a product of some of them."""
    arr = np.stack([tables(zeros(1 << b)) for b in range(bits)])
    arr.setflags(write=False)
    return arr


def apply_tables(tab: np.ndarray, v: np.ndarray) -> np.ndarray:
    """op(v) through op's four byte tables (uint32 arrays)."""
    v = np.asarray(v, dtype=U32)
    return (tab[0][v & 0xFF] ^ tab[1][(v >> U32(8)) & 0xFF] ^ tab[2][(v >> U32(16)) & 0xFF]
            ^ tab[3][v >> U32(24)]).astype(U32)


def shift(v: np.ndarray, n: np.ndarray) -> np.ndarray:
    """A^n[i](v[i]) for arrays of raw crcs and byte counts (each < 2^40)."""
    v, n = np.asarray(v, dtype=U32).copy(), np.asarray(n, dtype=np.uint64)
    logs = log_tables()
    for b in range(int(n.max()).bit_length() if n.size else 0):
        on = ((n >> np.uint64(b)) & np.uint64(1)).astype(bool)
        if on.any():
            v[on] = apply_tables(logs[b], v[on])
    return v


def raw(data: np.ndarray) -> np.ndarray:
    """Raw crcs of the rows of a uint8 matrix, byte by byte (short rows: rows of unequal length are zero-padded in
    front, which changes nothing)."""
    s = np.zeros(data.shape[0], dtype=U32)
    for j in range(data.shape[1]):
        s = BYTE_TABLE[(s ^ data[:, j]) & U32(0xFF)] ^ (s >> U32(8))
    return s.astype(U32)


def finish(raw_crc: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """crc32c of messages of `nbytes` bytes from their raw crcs: the initial value's part and the final xor."""
    return (np.asarray(raw_crc, dtype=U32) ^ shift(np.full(np.shape(nbytes), ONES, dtype=U32), nbytes)
            ^ U32(ONES)).astype(U32)
