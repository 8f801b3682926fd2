"""Pure: which DCP chunks a rank's snapshot holds. A manifest's own entries are whole local tensors (a DTensor's
shard, placed by its `global_offset`); its data-parallel share holds runs of elements of the replicated tensors
(plan.rep_cuts cuts at element boundaries), and a run of elements of a C-ordered tensor is a few boxes."""
from __future__ import annotations

import math
from typing import Any, NamedTuple, Sequence

from hpcft.snapshot import plan

ELEMENT = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
           "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16, "uint16": 2, "uint32": 4, "uint64": 8,
           "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1}


class Item(NamedTuple):
    """One DCP chunk: elements `offsets`..`offsets+sizes` of tensor `fqn` (global shape `shape`), whose bytes are
    [src, src+nbytes) of the rank's data file."""
    fqn: str
    entry: str
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    src: int
    nbytes: int


def fqn(entry: str) -> str:
    """The name DCP's flattening gives a state dict {"model": model.state_dict(), "optim": get_optimizer_state_dict}
    to an hpcft entry: `model/<n>` is `model.<n>`, `optim/<param>/<key>` is `optim.state.<param>.<key>`."""
    kind, _, rest = entry.partition("/")
    if kind == "optim":
        param, _, key = rest.rpartition("/")
        return f"optim.state.{param}.{key}"
    return f"{kind}.{rest}"


def element_size(dtype: str) -> int:
    try:
        return ELEMENT[dtype]
    except KeyError:
        raise ValueError(f"the durable tier does not know the element size of dtype {dtype!r}") from None


def boxes(shape: Sequence[int], a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Elements [a, b) of a C-ordered tensor of `shape` as boxes (offsets, sizes, first element), in order: a
    partial leading row, a run of whole rows, a partial trailing row (recursively in the inner dimensions)."""
    if a >= b:
        return []
    if not shape:
        return [((), (), 0)]
    if len(shape) == 1:
        return [((a,), (b - a,), a)]
    inner = math.prod(shape[1:])
    rest = tuple(shape[1:])
    out = []
    r = a // inner
    if a % inner:  # the partial first row
        end = min(b, (r + 1) * inner)
        out += [((r, *o), (1, *s), r * inner + f) for o, s, f in boxes(rest, a - r * inner, end - r * inner)]
        a, r = end, r + 1
    full = b // inner
    if full > r and a < b:
        out.append(((r, *(0,) * len(rest)), (full - r, *rest), r * inner))
        a = full * inner
    if a < b:  # the partial last row
        out += [((full, *o), (1, *s), full * inner + f) for o, s, f in boxes(rest, 0, b - full * inner)]
    return out


def place(e: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global shape, offset of the local tensor in it) of a manifest entry (or a live entry's `describe()`)."""
    p = e.get("placement") or {}
    local = tuple(e["shape"])
    return tuple(p.get("global_shape", local)), tuple(p.get("global_offset", (0,) * len(local)))


def of_manifest(m: dict[str, Any]) -> list[Item]:
    """Every chunk a rank's snapshot holds, in data-file order."""
    out = []
    for e in m["entries"]:
        shape, off = place(e)
        out.append(Item(fqn(e["name"]), e["name"], e["dtype"], shape, off, tuple(e["shape"]), e["offset"], e["nbytes"]))
    share = m.get("share")
    if share:
        rep = share["replicated"]
        lo, hi = share["range"]
        for p in plan.pieces_of_range([e["nbytes"] for e in rep], lo, hi, share["offset"]):
            e = rep[p.source]
            size = element_size(e["dtype"])
            if p.start % size or p.stop % size:
                raise ValueError(f"the share cuts {e['name']} inside an element (bytes {p.start}..{p.stop}); "
                                 "it was written by an hpcft older than the durable tier")
            shape, shift = place(e)
            for o, s, first in boxes(e["shape"], p.start // size, p.stop // size):
                out.append(Item(fqn(e["name"]), e["name"], e["dtype"], shape, tuple(x + y for x, y in zip(o, shift)),
                                s, p.offset + first * size - p.start, math.prod(s) * size))
    out.sort(key=lambda it: it.src)
    return out
