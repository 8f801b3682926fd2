"""The seal of a durable checkpoint's metadata, carried over from the memory tier. A sidecar embeds the store manifest
its rank was flushed from (`snapshot`: chunk checksums sealed with the step, RNG state, optimizer settings and
`extra`, hpcft.store.checksum.seal) and the crc32c of every sub-range of every store chunk (`pieces`). A reader trusts
nothing else: the rows must be the ones the manifest lays out, the sub-ranges must combine into the sealed chunk
checksums and each row's crc32c into its sub-ranges'; what a restore applies is the manifest's. An edit with the
files' checksums recomputed fails here (ManifestError): the checkpoint is lost, never loaded. Sidecars written
before the seal carry only their own `meta` (`sealed` False) and load as before."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from hpcft.durable import flush, items
from hpcft.errors import HpcftError, ManifestError
from hpcft.store import crcmath, seal, seal_key
from hpcft.store import manifest as mf
from hpcft.store.manifest import is_int

_COLUMNS = ("name", "entry", "dtype", "global shape", "offsets", "sizes", "data offset", "byte count", "crc32c",
            "record offset", "record length")


def sealed(side: dict[str, Any]) -> bool:
    """Whether the sidecar carries the seal (else it was written by an hpcft older than it)."""
    return side.get("format") != flush.UNSEALED_FORMAT


def snapshot(side: dict[str, Any], path: Path | str) -> dict[str, Any]:
    """The store manifest a sealed sidecar embeds, its own checksum verified (ManifestError otherwise)."""
    raw = side.get("snapshot")
    try:
        if not isinstance(raw, str):
            raise ManifestError("it embeds none")
        return mf.decode(raw.encode("ascii", "replace"), "<embedded>")
    except HpcftError as exc:
        raise ManifestError(f"{path}: the store manifest it was flushed from is unusable: {exc}") from None


def applied(m: dict[str, Any]) -> dict[str, Any]:
    """What a restore applies besides tensors (RNG state, `extra`, optimizer settings, ...), from a store manifest."""
    return {k: m.get(k) for k in flush.META}


def meta(side: dict[str, Any], path: Path | str) -> dict[str, Any]:
    """`applied` of the manifest a sealed sidecar embeds; an older sidecar's own `meta`."""
    if not sealed(side):
        return side["meta"] if isinstance(side.get("meta"), dict) else {}
    return applied(snapshot(side, path))


def check(side: dict[str, Any], path: Path | str, step: int, world: int) -> dict[str, Any]:
    """Verify a sealed sidecar of checkpoint `step` (written at `world`) against its seal; its embedded manifest.
    ManifestError naming `path` and the first thing that differs."""
    from hpcft.snapshot.schema import check_types  # imports torch: not in the agents, which only write

    m = snapshot(side, path)
    try:
        check_types(m)
    except ManifestError as exc:
        raise ManifestError(f"{path}: the store manifest it was flushed from is unusable: {exc}") from None
    for key, got, want in (("step", side.get("step"), m.get("step")), ("rank", side.get("rank"), m.get("rank")),
                           ("step", step, m.get("step"))):
        if got != want:
            raise ManifestError(f"{path} says {key} {got!r}, but the store manifest it was flushed from is {key} "
                                f"{want!r}: it was edited")
    if is_int(m.get("world")) and m["world"] != world:
        raise ManifestError(f"{path} was flushed from a snapshot of world size {m['world']}, in a checkpoint of world "
                            f"size {world}")
    try:
        its = items.of_manifest(m)
        rows, size = flush.rows_of(its)
    except (KeyError, TypeError, ValueError) as exc:
        raise ManifestError(f"{path}: its store manifest's entries cannot be laid out ({exc})") from None
    _same_rows(side, m, rows, size, path)
    _same_crcs(side, m, its, path)
    return m


def _same_rows(side: dict[str, Any], m: dict[str, Any], rows: list[list[Any]], size: int, path: Path | str) -> None:
    """The sidecar's rows, file and group are the ones the manifest gives, but for the crc32c (`_same_crcs`)."""
    have = side.get("items")
    if not isinstance(have, list) or len(have) != len(rows):
        raise ManifestError(f"{path} lists {len(have) if isinstance(have, list) else 'no'} chunk rows; the store "
                            f"manifest it was flushed from lays out {len(rows)}")
    for i, (got, want) in enumerate(zip(have, rows)):
        if not isinstance(got, list) or len(got) != len(want):
            raise ManifestError(f"{path}: row {i} is not a chunk row")
        diff = next((c for c in range(len(want)) if c != flush.CRC and got[c] != want[c]), None)
        if diff in (flush.FQN, flush.ENTRY):
            raise ManifestError(f"{path}: row {i} is {got[diff]}, but the store manifest it was flushed from has "
                                f"{want[diff]} there: it was edited")
        if diff is not None:
            raise ManifestError(f"{path}: row {i} ({got[flush.FQN]}) says {_COLUMNS[diff]} {got[diff]!r}, but the "
                                f"store manifest it was flushed from gives {want[diff]!r}: it was edited")
    for key, want in (("file", flush.data_name(int(m["rank"]))), ("file_bytes", size), ("group", flush.group_of(m))):
        if side.get(key) != want:
            raise ManifestError(f"{path} says {key} {side.get(key)!r}; the store manifest it was flushed from gives "
                                f"{want!r}: it was edited")


def _same_crcs(side: dict[str, Any], m: dict[str, Any], its: list[items.Item], path: Path | str) -> None:
    """Each store chunk's sub-range crc32cs combine into its sealed checksum, each row's into the row's crc32c."""
    chunks, pieces, key = m["chunks"], side.get("pieces"), seal_key(m)
    if not isinstance(pieces, list) or len(pieces) != len(chunks):
        raise ManifestError(f"{path} has no sub-range checksum list for each of its store manifest's "
                            f"{len(chunks)} chunks")
    crcs = [0] * len(its)
    for (lo, _, recorded), cut, got in zip(chunks, flush.cuts(chunks, its), pieces):
        if not isinstance(got, list) or len(got) != len(cut) or not all(is_int(c) for c in got):
            raise ManifestError(f"{path}: the sub-range checksums of the chunk at offset {lo} are not one per "
                                "sub-range")
        run = 0
        for (a, b, i), c in zip(cut, got):
            run = c if a == lo else crcmath.combine(run, c, b - a)
            if i is not None:
                crcs[i] = crcmath.combine(crcs[i], c, b - a)
        if seal(run, key) != recorded:
            raise ManifestError(f"{path}: the store chunk at offset {lo} does not match its seal: the step, RNG "
                                "state, optimizer settings or extra of the store manifest it embeds (step "
                                f"{m['step']}) are not the ones its data was written with: they were edited")
    for i, (row, want) in enumerate(zip(side["items"], crcs)):
        if row[flush.CRC] != want:
            raise ManifestError(f"{path}: row {i} ({row[flush.FQN]}) says crc32c {row[flush.CRC]}; its sealed "
                                f"chunks give {want}: it was edited")
