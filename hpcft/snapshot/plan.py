"""Pure planning: split replicated bytes across data-parallel members, lay out a data file, cut chunks. Nothing here
touches tensors or files."""
import bisect
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

ALIGN = 64  # file offsets and share cuts are multiples of this (cache lines; full-speed memcpy)


def align_up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


def share_cuts(total: int, members: int, align: int = ALIGN) -> list[int]:
    """Cut points 0 = c0 <= ... <= c_members = total of a byte stream (members >= 1), balanced within `align` bytes."""
    inner = [min(total, (total * i // members) // align * align) for i in range(1, members)]
    return [0, *inner, total]


def rep_cuts(sizes: Sequence[int], members: int, grains: Sequence[int] | None = None) -> list[int]:
    """`share_cuts` of the concatenation of `sizes`, each inner cut moved down to an element boundary (`grains`:
    element sizes; None: bytes), so a share's piece of a tensor is a run of elements (see hpcft.durable.items)."""
    cuts = share_cuts(sum(sizes), members)
    if not grains:
        return cuts
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    out = [cuts[0]]
    for c in cuts[1:-1]:
        i = max(0, bisect.bisect_right(starts, c) - 1)  # the tensor [starts[i], starts[i+1]) holding byte c
        g = grains[i] if i < len(grains) else 1
        out.append(max(out[-1], c - (c - starts[i]) % g))
    return [*out, cuts[-1]]


class Piece(NamedTuple):
    """Bytes [start, stop) of source `source` live at `offset` in the data file."""
    source: int
    start: int
    stop: int
    offset: int

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


def pieces_of_range(sizes: Sequence[int], lo: int, hi: int, base: int) -> list[Piece]:
    """The pieces of the concatenation of `sizes` that fall in [lo, hi), placed contiguously from `base`."""
    out, pos = [], 0
    for i, n in enumerate(sizes):
        a, b = max(lo, pos), min(hi, pos + n)
        if a < b:
            out.append(Piece(i, a - pos, b - pos, base + (a - lo)))
        pos += n
    return out


@dataclass(frozen=True)
class Layout:
    """Where each piece goes: own sources first (each aligned), then this member's share, contiguous."""
    pieces: tuple[Piece, ...]
    share_offset: int
    share_range: tuple[int, int]  # [lo, hi) of the replicated stream held here
    nbytes: int


def layout(own_sizes: Sequence[int], rep_sizes: Sequence[int], member: int, members: int,
           rep_grains: Sequence[int] | None = None) -> Layout:
    """Lay out own sources (indices 0..len(own)-1) and this member's share of the replicated ones (indices
    len(own)..), the concatenation of `rep_sizes` cut at element boundaries (`rep_cuts`)."""
    pieces, off = [], 0
    for i, n in enumerate(own_sizes):
        pieces.append(Piece(i, 0, n, off))
        off = align_up(off + n)
    cuts = rep_cuts(rep_sizes, members, rep_grains)
    lo, hi = cuts[member], cuts[member + 1]
    share = pieces_of_range(rep_sizes, lo, hi, off)
    pieces += [Piece(p.source + len(own_sizes), p.start, p.stop, p.offset) for p in share]
    return Layout(tuple(pieces), off, (lo, hi), align_up(off + hi - lo))


class Segment(NamedTuple):
    """One contiguous copy: bytes [start, start+nbytes) of `source` to file offset `offset`."""
    source: int
    start: int
    offset: int
    nbytes: int


class Chunk(NamedTuple):
    """Bytes [offset, offset+nbytes) of the data file: the unit of copy, checksum and loss."""
    offset: int
    nbytes: int
    segments: tuple[Segment, ...]


class Grid:
    """`nbytes` of a data file holding `pieces`, cut into chunks of `chunk_bytes` (the last one shorter); `chunk(i)`
    lists the segments chunk i covers, planned as a worker takes it."""

    def __init__(self, pieces: Sequence[Piece], nbytes: int, chunk_bytes: int):
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive (got {chunk_bytes})")
        self.nbytes, self.chunk_bytes = nbytes, chunk_bytes
        self.count = -(-nbytes // chunk_bytes)
        self._spans = sorted((p.offset, p.offset + p.stop - p.start, p.source, p.start) for p in pieces)
        self._ends = [s[1] for s in self._spans]  # pieces are disjoint, so their ends are sorted too
        self._planned: list[Chunk | None] = [None] * self.count
        self._table: Table | None = None

    def table(self) -> "Table":
        """Every chunk's segments at once, as arrays (computed once per grid): what a loop in C walks."""
        if self._table is None:
            self._table = _table(self._spans, self.nbytes, self.chunk_bytes, self.count)
        return self._table

    def chunk(self, i: int) -> "Chunk":
        planned = self._planned[i]
        if planned is None:  # two workers never take one i; a list slot is written atomically under the GIL
            planned = self._planned[i] = self._plan(i)
        return planned

    def _plan(self, i: int) -> "Chunk":
        lo = i * self.chunk_bytes
        hi = min(self.nbytes, lo + self.chunk_bytes)
        spans, segs = self._spans, []
        for j in range(bisect.bisect_right(self._ends, lo), len(spans)):
            off, end, source, start = spans[j]
            if off >= hi:
                break
            a, b = max(lo, off), min(hi, end)
            if a < b:
                segs.append(Segment(source, start + (a - off), a, b - a))
        return Chunk(lo, hi - lo, tuple(segs))


class Table(NamedTuple):
    """The segments of every chunk of a Grid, in file order: segment j copies `nbytes[j]` bytes between byte
    `start[j]` of `source[j]` and file offset `offset[j]`; chunk i is [bounds[i], bounds[i + 1]), from segment
    first[i]."""
    source: np.ndarray
    start: np.ndarray
    offset: np.ndarray
    nbytes: np.ndarray
    first: np.ndarray
    bounds: np.ndarray


def _table(spans: Sequence[tuple[int, int, int, int]], nbytes: int, chunk_bytes: int, count: int) -> Table:
    """`Grid.table`: each span (file offset, end, source, start) cut at every chunk boundary, with no Python loop."""
    u64 = np.uint64
    lo, hi, source, start = (np.array(c, dtype=np.int64) for c in zip(*spans)) if spans else \
        (np.zeros(0, dtype=np.int64),) * 4
    keep = hi > lo
    lo, hi, source, start = lo[keep], hi[keep], source[keep], start[keep]
    firsts = lo // chunk_bytes
    per = (hi - 1) // chunk_bytes - firsts + 1 if lo.size else np.zeros(0, dtype=np.int64)
    span = np.repeat(np.arange(lo.size), per)
    chunk = firsts[span] + np.arange(span.size) - np.repeat(np.cumsum(per) - per, per)
    a = np.maximum(lo[span], chunk * chunk_bytes)
    b = np.minimum(hi[span], np.minimum((chunk + 1) * chunk_bytes, nbytes))
    order = np.argsort(a, kind="stable")  # spans are disjoint: file order is chunk order
    a, b, span = a[order], b[order], span[order]
    bounds = np.minimum(np.arange(count + 1, dtype=np.int64) * chunk_bytes, nbytes)
    return Table(source[span].astype(u64), (start[span] + a - lo[span]).astype(u64), a.astype(u64),
                 (b - a).astype(u64), np.searchsorted(a, bounds, side="left").astype(u64), bounds.astype(u64))


def table_of(chunks: Sequence[Chunk]) -> Table:
    """The Table of a list of planned chunks (consecutive, as `chunks` cuts them)."""
    segs = [s for c in chunks for s in c.segments]
    cols = [np.array(col, dtype=np.uint64) for col in zip(*segs)] if segs else [np.zeros(0, dtype=np.uint64)] * 4
    first = np.cumsum([0] + [len(c.segments) for c in chunks]).astype(np.uint64)
    bounds = np.array([c.offset for c in chunks] + ([chunks[-1].offset + chunks[-1].nbytes] if chunks else [0]),
                      dtype=np.uint64)
    return Table(*cols, first, bounds)


def chunks(pieces: Sequence[Piece], nbytes: int, chunk_bytes: int) -> list[Chunk]:
    """Cut [0, nbytes) into chunks of `chunk_bytes` (last one shorter) with the segments each covers."""
    grid = Grid(pieces, nbytes, chunk_bytes)
    return [grid.chunk(i) for i in range(grid.count)]
