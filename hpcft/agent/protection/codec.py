"""Erasure codes over equal-length byte blocks: XOR (one parity block, numpy in place) and Reed–Solomon
(k parity blocks, zfec). Block numbers 0..n−k−1 are data, n−k..n−1 parity, as in zfec."""
from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import numpy as np

from hpcft.deps import require
from hpcft.errors import ConfigError, IntegrityError

CHUNK = 256 << 10  # XOR works chunk by chunk: the parity chunk stays in L2 while every source is added


class Unrecoverable(IntegrityError):
    """More blocks of a stripe (or copies of a snapshot) are lost than the scheme tolerates."""


class Codec:
    """`n` blocks per stripe, `k` of them parity; any n−k blocks rebuild the rest."""

    def __init__(self, n: int, k: int):
        if not 1 <= k < n:
            raise ConfigError(f"an erasure code needs 1 <= parity blocks < blocks (got k={k}, n={n})")
        self.n, self.k = n, k

    @property
    def data_blocks(self) -> int:
        return self.n - self.k

    def encode(self, data: Sequence[np.ndarray], parity: Sequence[np.ndarray]) -> None:
        """Write the k parity blocks of `data` (n−k equal-length uint8 arrays) into `parity`, in place."""
        self.encode_some(data, dict(enumerate(parity)))

    def encode_some(self, data: Sequence[np.ndarray], parity: Mapping[int, np.ndarray]) -> None:
        """Write only the parity blocks `parity` (parity index t → output array): what one holder needs."""
        raise NotImplementedError

    def decode(self, have: Mapping[int, np.ndarray], want: Mapping[int, np.ndarray]) -> None:
        """Fill the blocks `want` (block number → output array) from the blocks `have`."""
        raise NotImplementedError

    def _check(self, have: Mapping[int, np.ndarray], want: Mapping[int, np.ndarray]) -> None:
        if len(have) < self.data_blocks:
            raise Unrecoverable(f"a stripe of {self.n} blocks lost {self.n - len(have)}; it tolerates {self.k}")
        bad = [b for b in list(have) + list(want) if not 0 <= b < self.n]
        if bad:
            raise ConfigError(f"block numbers {bad} are outside 0..{self.n - 1}")


class XorCodec(Codec):
    """One parity block: the XOR of the data blocks (RAID-5)."""

    def __init__(self, n: int):
        super().__init__(n, 1)

    def encode_some(self, data: Sequence[np.ndarray], parity: Mapping[int, np.ndarray]) -> None:
        for out in parity.values():
            xor_into(out, data)

    def decode(self, have: Mapping[int, np.ndarray], want: Mapping[int, np.ndarray]) -> None:
        self._check(have, want)
        if len(want) > 1 or set(want) & set(have):
            raise ConfigError(f"XOR rebuilds the one missing block of a stripe (asked for {sorted(want)})")
        for out in want.values():  # `have` holds every other block: their XOR is the missing one
            xor_into(out, list(have.values()))


def xor_into(out: np.ndarray, sources: Sequence[np.ndarray], chunk: int = CHUNK) -> None:
    """out = XOR of `sources` (short ones zero-padded), in place, chunk by chunk (the chunk of `out` stays in cache
    while every source is added), with no allocation."""
    n = out.size
    if any(s.size > n for s in sources):
        raise ConfigError(f"XOR sources must not be longer than the output (got {[s.size for s in sources]} into {n})")
    srcs = sorted(sources, key=lambda s: -s.size)
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        o = out[lo:hi]
        parts = [s[lo:hi] for s in srcs if s.size > lo]
        if not parts:
            o[:] = 0
            continue
        first = parts[0]
        if len(parts) > 1 and parts[1].size == first.size:
            np.bitwise_xor(first, parts[1], out=o[:first.size])
            rest = parts[2:]
        else:
            np.copyto(o[:first.size], first)
            rest = parts[1:]
        o[first.size:] = 0
        for s in rest:
            np.bitwise_xor(o[:s.size], s, out=o[:s.size])


class XorFold:
    """A parity block built in place as pieces arrive, from any thread: the first bytes to reach a region of `out`
    are copied, later ones XORed in; `finish()` zeroes what no piece covered (short pieces are zero-padded)."""

    def __init__(self, out: np.ndarray, grid: int = CHUNK):
        self.out, self.grid = out, grid
        self._filled = np.zeros(-(-out.size // grid), dtype=np.int64)  # bytes initialised in each grid cell
        self._lock = threading.Lock()

    def add(self, offset: int, data: np.ndarray) -> None:
        """Fold `data` into out[offset:offset+len]; `offset` must be on the grid, `data` at most one cell long."""
        cell, n = divmod(offset, self.grid)
        if n or data.size > self.grid or offset + data.size > self.out.size:
            raise ConfigError(f"fold of {data.size} bytes at offset {offset} is off the {self.grid}-byte grid "
                              f"of a {self.out.size}-byte block")
        o = self.out[offset:offset + data.size]
        with self._lock:
            done = int(self._filled[cell])
            head = min(done, data.size)
            np.bitwise_xor(o[:head], data[:head], out=o[:head])
            if data.size > done:
                np.copyto(o[done:], data[done:])
                self._filled[cell] = data.size

    def finish(self) -> None:
        """Zero every byte no piece reached (a stripe whose pieces all end early)."""
        for cell, done in enumerate(self._filled.tolist()):
            lo = cell * self.grid
            hi = min(self.out.size, lo + self.grid)
            if lo + done < hi:
                self.out[lo + done:hi] = 0


class RsCodec(Codec):
    """Reed–Solomon over GF(2^8) by zfec: any n−k of the n blocks rebuild the others."""

    def __init__(self, n: int, k: int, chunk: int = 1 << 20):
        super().__init__(n, k)
        zfec = require("zfec", "Reed-Solomon protection (scheme rs)")
        if n > 256:
            raise ConfigError(f"Reed-Solomon sets hold at most 256 members (got {n})")
        self._enc = zfec.Encoder(self.data_blocks, n)
        self._dec = zfec.Decoder(self.data_blocks, n)
        self.chunk = chunk  # zfec returns new bytes objects: bound them by coding chunk by chunk

    def encode_some(self, data: Sequence[np.ndarray], parity: Mapping[int, np.ndarray]) -> None:
        nums = tuple(self.data_blocks + t for t in parity)
        outs = list(parity.values())
        size = outs[0].size
        for lo in range(0, size, self.chunk):
            hi = min(size, lo + self.chunk)
            blocks = self._enc.encode([_span(d, lo, hi) for d in data], nums)
            for p, block in zip(outs, blocks):
                p[lo:hi] = np.frombuffer(block, dtype=np.uint8)

    def decode(self, have: Mapping[int, np.ndarray], want: Mapping[int, np.ndarray]) -> None:
        self._check(have, want)
        nums = sorted(have)[:self.data_blocks]
        size = max(a.size for a in [*have.values(), *want.values()])
        lost_parity = [b for b in want if b >= self.data_blocks]
        for lo in range(0, size, self.chunk):
            hi = min(size, lo + self.chunk)
            data = self._dec.decode([_span(have[b], lo, hi) for b in nums], nums)
            for b, out in want.items():
                if b < self.data_blocks:
                    out[lo:hi] = np.frombuffer(data[b], dtype=np.uint8)
            if lost_parity:
                blocks = self._enc.encode(data, tuple(lost_parity))
                for b, block in zip(lost_parity, blocks):
                    want[b][lo:hi] = np.frombuffer(block, dtype=np.uint8)


def _span(block: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """block[lo:hi] as a view, or (only for the chunk where a short block ends) a zero-padded copy."""
    view = block[lo:hi]
    if view.size == hi - lo:
        return view
    padded = np.zeros(hi - lo, dtype=np.uint8)
    padded[:view.size] = view
    return padded


def codec_for(scheme: str, n: int, k: int) -> Codec:
    """The codec of a set of `n` members tolerating `k` losses under `scheme` (xor or rs)."""
    if scheme == "xor":
        return XorCodec(n)
    if scheme == "rs":
        return RsCodec(n, k)
    raise ConfigError(f"scheme {scheme!r} has no erasure code (only xor and rs do)")
