"""Pure box arithmetic of hpcft's durable reader. A box is (offsets, sizes) in a tensor's global index space: a
live tensor needs one (a DTensor's shard, or the whole tensor), a checkpoint's rows each hold one. `select` finds
rows that tile the box a rank needs, trying tiers of preference in order (own rows, its group's, anyone's)."""
from __future__ import annotations

import math
from typing import Any, Iterable, NamedTuple, Sequence

Ints = tuple[int, ...]


class Box(NamedTuple):
    offsets: Ints
    sizes: Ints

    @property
    def volume(self) -> int:
        return math.prod(self.sizes)


class Part(NamedTuple):
    """Where a row overlaps the box: `row` (the caller's), the overlap `box`, and its slices in the row's tensor
    (`src`) and in the box's tensor (`dst`)."""
    row: Any
    box: Box
    src: tuple[slice, ...]
    dst: tuple[slice, ...]


def overlap(a: Box, b: Box) -> Box | None:
    """The intersection of two boxes of the same tensor, None if it is empty (a 0-dim tensor's boxes always meet)."""
    lo = tuple(max(x, y) for x, y in zip(a.offsets, b.offsets))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a.offsets, a.sizes, b.offsets, b.sizes))
    if any(h <= low for low, h in zip(lo, hi)):
        return None
    return Box(lo, tuple(h - low for low, h in zip(lo, hi)))


def within(inner: Box, outer: Box) -> tuple[slice, ...]:
    """The slices of `inner` in a tensor holding `outer` (inner lies inside outer)."""
    return tuple(slice(i - o, i - o + n) for i, o, n in zip(inner.offsets, outer.offsets, inner.sizes))


def parts(want: Box, rows: Sequence[tuple[Any, Box]]) -> list[Part] | None:
    """The rows' overlaps with `want` if they tile it exactly (no two of them start at the same index, and their
    overlaps add up to its volume; rows of one writer never overlap, see hpcft.durable.items), else None."""
    out, seen, got = [], set(), 0
    for row, box in rows:
        if box.volume == 0:
            continue
        o = overlap(want, box)
        if o is None:
            continue
        if o.offsets in seen:
            return None
        seen.add(o.offsets)
        got += o.volume
        out.append(Part(row, o, within(o, box), within(o, want)))
    return out if got == want.volume else None


def select(want: Box, tiers: Iterable[Sequence[tuple[Any, Box]]]) -> tuple[int, list[Part]] | None:
    """The first tier whose rows tile `want`, and its parts; None if none does. An empty box takes nothing. The
    tiers are taken one at a time (a generator may read a tier's rows only when the ones before it fell short)."""
    if want.volume == 0:
        return 0, []
    for i, rows in enumerate(tiers):
        got = parts(want, rows)
        if got is not None:
            return i, got
    return None
