"""What restore checks in a manifest before it loads a byte. A manifest passes its own checksum even where a person
edited it and recomputed that, so restore trusts nothing it can compute itself: the fields must have the schema's
types, the entries must be the live state's in order (else a CheckpointError naming the first difference), and the
layout must be the one the live tensors give (else a ManifestError: the version is lost). The step is bound to the
data by the chunk checksums (`hpcft.store.checksum.seal`)."""
from typing import Any, Sequence

from hpcft.errors import CheckpointError, ManifestError
from hpcft.snapshot import plan
from hpcft.snapshot.engine import signature
from hpcft.snapshot.groups import Group
from hpcft.snapshot.state import Entry, lay_out
from hpcft.store.manifest import is_int


def is_count(v: Any) -> bool:
    """A whole number of at least 0 (a size, an offset, a rank)."""
    return is_int(v) and v >= 0


def _counts(values: Any) -> bool:
    """Every value a count (`is_count`), without a Python call per value: JSON gives plain ints, never subclasses."""
    return all(type(v) is int and v >= 0 for v in values)


def _entry_problem(e: dict[str, Any]) -> str:
    """What is wrong with one manifest entry's types ("" if nothing; a message only for a failure)."""
    if not (isinstance(e.get("name"), str) and isinstance(e.get("dtype"), str)):
        return "has no name or dtype"
    if not (isinstance(e.get("shape"), list) and _counts(e["shape"])):
        return "shape is not a list of sizes"
    if not (is_count(e.get("nbytes")) and is_count(e.get("offset"))):
        return "nbytes/offset are not byte counts"
    if not (e.get("placement") is None or isinstance(e["placement"], dict)):
        return "placement is not an object"
    return ""


def _want(ok: bool, what: str) -> None:
    if not ok:
        raise ManifestError(f"the manifest's {what}")


def check_types(m: dict[str, Any]) -> None:
    """Every field restore reads has the schema's type (ManifestError naming the first that does not)."""
    _want(is_count(m.get("data_bytes")), f"data_bytes {m.get('data_bytes')!r} is not a byte count")
    _want(is_count(m.get("chunk_bytes")) and m["chunk_bytes"] > 0, f"chunk_bytes {m.get('chunk_bytes')!r} is not a "
          "positive byte count")
    chunks = m.get("chunks")
    _want(isinstance(chunks, list) and all(isinstance(c, list) and len(c) == 3 for c in chunks)
          and _counts(x for c in chunks for x in c), "chunk table is not a list of [offset, nbytes, crc]")
    entries = m.get("entries")
    _want(isinstance(entries, list) and all(isinstance(e, dict) for e in entries), "entries are not a list of objects")
    for i, e in enumerate(entries):
        problem = _entry_problem(e)
        if problem:
            raise ManifestError(f"the manifest's entry {i} {problem}")
    share = m.get("share")
    if share is not None:
        _want(isinstance(share, dict), "share is not an object")
        rng = share.get("range")
        _want(all(is_count(share.get(k)) for k in ("members", "member", "offset")) and is_int(share.get("signature"))
              and isinstance(rng, list) and len(rng) == 2 and all(map(is_count, rng)),
              "share has not the schema's members, member, offset, signature and range")
    _want(isinstance(m.get("rng"), dict), "rng is not an object")
    _want(m.get("extra") is None or isinstance(m["extra"], dict), "extra is not an object")
    _want(m.get("optim") is None or isinstance(m["optim"], dict), "optim is not an object")


def _show(d: tuple | None) -> str:
    if d is None:
        return "nothing"
    name, dtype, shape, placement = d
    return f"{name} {dtype} {shape}" + (f" {placement}" if placement else "")


def check_structure(m: dict[str, Any], own: Sequence[Entry], rep: Sequence[Entry], group: Group | None) -> None:
    """The snapshot holds the live state's entries, in the live order, split over the same data-parallel group;
    CheckpointError naming the first difference (saved side, live side) otherwise."""
    saved = [(e["name"], e["dtype"], e["shape"], e.get("placement")) for e in m["entries"]]
    live = [e.key() for e in own]
    if saved != live:
        i = next(i for i in range(max(len(saved), len(live)))
                 if i >= min(len(saved), len(live)) or saved[i] != live[i])
        s, lv = (saved[i] if i < len(saved) else None), (live[i] if i < len(live) else None)
        where = ""
        if s is not None and s[0] in [x[0] for x in live] and (lv is None or lv[0] != s[0]):
            where = f" (order differs: the live state has {s[0]} at entry {[x[0] for x in live].index(s[0])})"
        raise CheckpointError(
            f"the snapshot does not match the live model/optimizer ({len(saved)} entries saved, {len(live)} live): "
            f"entry {i} is saved as {_show(s)} but live as {_show(lv)}{where}; restore into the same model, "
            "layout and optimizer")
    share = m.get("share")
    live_share = (group.size, group.member, signature(rep)) if rep else None
    saved_share = (share["members"], share["member"], share["signature"]) if share else None
    if saved_share != live_share:
        raise CheckpointError(
            "the snapshot was split over a different data-parallel group or replicated state than the live one "
            f"(saved members, member, signature: {saved_share}; live: {live_share})")


def check_layout(m: dict[str, Any], own: Sequence[Entry], rep: Sequence[Entry], group: Group | None) -> plan.Grid:
    """The chunk grid restore will load, computed from the live tensors: what the manifest says must equal it
    (ManifestError naming the first offset, size, share or chunk row that does not)."""
    lay = lay_out(own, rep, group)
    for i, (e, d) in enumerate(zip(own, m["entries"])):
        if d["nbytes"] != e.nbytes or d["offset"] != lay.pieces[i].offset:  # the message only for a failure
            _want(False, f"entry {i} ({e.name}) says {d['nbytes']} bytes at offset {d['offset']}; the live layout "
                  f"puts {e.nbytes} bytes at {lay.pieces[i].offset}")
    _want(m["data_bytes"] == lay.nbytes, f"data_bytes {m['data_bytes']} is not the layout's {lay.nbytes}")
    if rep:
        share = m["share"]
        _want(share["range"] == list(lay.share_range) and share["offset"] == lay.share_offset,
              f"share range {share['range']} at {share['offset']} is not the layout's {list(lay.share_range)} at "
              f"{lay.share_offset}")
    grid = plan.Grid(lay.pieces, lay.nbytes, m["chunk_bytes"])
    size, total, recorded = grid.chunk_bytes, grid.nbytes, m["chunks"]
    _want(len(recorded) == grid.count and all(r[0] == i * size and r[1] == min(size, total - i * size)
                                              for i, r in enumerate(recorded)),
          "chunk table does not match its layout")
    return grid
