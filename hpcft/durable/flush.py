"""Write one rank's snapshot of one step into a durable checkpoint directory: its chunks as torch.save records
(`__<rank>_0.distcp`, read by plain `dcp.load`) straight from the store, and a JSON sidecar (`.hpcft/rank-<r>.json`)
listing each chunk's place and a crc32c carried over from the store's (hpcft.store.crcmath), so hpcft reads it back
without unpickling anything. The sidecar embeds the store's manifest and the crc32c of every sub-range its chunk
checksums combine from: what hpcft.durable.seal checks."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from hpcft import events
from hpcft.durable import files, items
from hpcft.durable.envelope import envelope
from hpcft.errors import IntegrityError, StoreError
from hpcft.store import crc32c, crcmath, seal, seal_key
from hpcft.store import manifest as mf
from hpcft.store.paths import rank_name, read_file

RANK_FORMAT = "hpcft-durable-rank/2"  # /2: the store's manifest and the sealed chunks' sub-range crcs embedded
UNSEALED_FORMAT = "hpcft-durable-rank/1"  # written before the seal: `meta` beside the rows, nothing binds them
META = ("rng", "extra", "optim", "world", "job_id", "writer", "time")  # what a restore applies besides tensors
Cut = tuple[int, int, int | None]  # a sub-range of a store chunk: [start, end) and the item it holds (None: padding)
# a sidecar row: fqn, entry, dtype, global shape, offsets, sizes, data offset, nbytes, crc, record offset, length
FQN, ENTRY, DTYPE, SHAPE, OFFSETS, SIZES, DATA, NBYTES, CRC, RECORD, LENGTH = range(11)


def sidecar_dir(ckpt: Path) -> Path:
    return ckpt / ".hpcft"


def sidecar(ckpt: Path, rank: int) -> Path:
    """`<ckpt>/.hpcft/rank-<r>.json`: rank r's sidecar, beside its DCP data file (`data_name`)."""
    return sidecar_dir(ckpt) / f"{rank_name(rank)}.json"


def data_name(rank: int) -> str:
    return f"__{rank}_0.distcp"


def cuts(chunks: Sequence[Sequence[int]], its: Sequence[items.Item]) -> Iterator[list[Cut]]:
    """Per store chunk `[offset, nbytes, crc]`, in order: its sub-ranges cut at every item boundary (pure; the
    flush checks and records the crc32c of each, a reader combines them again)."""
    j = 0
    for lo, n, _ in chunks:
        hi, pos, out = lo + n, lo, []
        while pos < hi:
            while j < len(its) and its[j].src + its[j].nbytes <= pos:
                j += 1
            inside = j < len(its) and its[j].src <= pos
            end = min(hi, its[j].src + its[j].nbytes) if inside else min(hi, its[j].src if j < len(its) else hi)
            out.append((pos, end, j if inside else None))
            pos = end
        yield out


def _chunks_verified(data: np.ndarray, chunks: Sequence[Sequence[int]], its: Sequence[items.Item], key: int,
                     rank: int, step: int) -> Iterator[list[tuple[int, int, int | None, int]]]:
    """Per store chunk, (start, end, item index or None, crc32c) of each sub-range (`cuts`), checked against the
    sealed checksum before the next chunk is read; IntegrityError (event `chunk_lost`) at the first that fails."""
    for (lo, _, recorded), cut in zip(chunks, cuts(chunks, its)):
        run, parts = 0, []
        for a, b, i in cut:
            c = crc32c(data[a:b])
            run = c if a == lo else crcmath.combine(run, c, b - a)
            parts.append((a, b, i, c))
        if seal(run, key) != recorded:
            events.emit("chunk_lost", level=logging.ERROR, rank=rank, step=step, offset=lo, reason="durable flush")
            raise IntegrityError(f"rank {rank} step {step}: the store's chunk at offset {lo} fails its crc32c; "
                                 "this step is not flushed")
        yield parts  # verified: now written, while the chunk is still in the cache


def rows_of(its: Sequence[items.Item]) -> tuple[list[list[Any]], int]:
    """The sidecar's rows of a snapshot's items (crc32c 0: filled by the writer) and the data file's size (pure): the
    records of empty items first, then the others in data order, back to back, as `write_rank` writes them."""
    out: list[list[Any]] = [[] for _ in its]
    pos = 0
    for i in [i for i, it in enumerate(its) if it.nbytes == 0] + [i for i, it in enumerate(its) if it.nbytes]:
        it = its[i]
        prefix, suffix = envelope(it.dtype, it.sizes)
        length = len(prefix) + it.nbytes + len(suffix)
        out[i] = [it.fqn, it.entry, it.dtype, list(it.shape), list(it.offsets), list(it.sizes), pos + len(prefix),
                  it.nbytes, 0, pos, length]
        pos += length
    return out, pos


def group_of(manifest: dict[str, Any]) -> list[int]:
    """The data-parallel group whose shares tile the replicated tensors: where hpcft's reader finds the rest."""
    return list((manifest.get("share") or {}).get("group") or [int(manifest["rank"])])


def write_rank(manifest: dict[str, Any], data: np.ndarray, ckpt: Path, *, pace: Callable[[int], None] | None = None,
               sync: bool = True) -> dict[str, Any]:
    """Write the rank's chunks and sidecar into `ckpt` (which exists); the sidecar. One pass: each store chunk is
    verified, then written; each item's crc32c is combined from the verified sub-ranges'. A failure leaves a partial
    file the commit never sees (it needs every rank's sidecar)."""
    rank, step = int(manifest["rank"]), int(manifest["step"])
    its = items.of_manifest(manifest)
    rows, size = rows_of(its)
    name = data_name(rank)
    path = ckpt / name
    crcs = [0] * len(its)
    pieces: list[list[int]] = []  # per store chunk, the crc32c of its sub-ranges: what a reader checks the seal with
    fd = files.create(path)
    pos = whole = 0  # whole: the file's crc32c, its data parts combined from the verified ones (for a drain's check)

    def put(*bufs: Any) -> None:
        nonlocal pos
        pos += files.write_all(fd, bufs[0], path, pace) if len(bufs) == 1 else files.write_many(fd, bufs, path, pace)

    try:
        for it in its:
            if it.nbytes == 0:  # no sub-range reaches it
                record = b"".join(envelope(it.dtype, it.sizes))
                whole = crc32c(record, whole)
                put(record)
        for parts in _chunks_verified(data, manifest["chunks"], its, seal_key(manifest), rank, step):
            pieces.append([c for _, _, _, c in parts])
            for a, b, i, c in parts:
                if i is None:
                    continue
                it = its[i]
                prefix, suffix = envelope(it.dtype, it.sizes)
                head = prefix if a == it.src else b""
                tail = suffix if b == it.src + it.nbytes else b""
                crcs[i] = crcmath.combine(crcs[i], c, b - a)
                whole = crc32c(tail, crcmath.combine(crc32c(head, whole), c, b - a))
                put(*(x for x in (head, data[a:b], tail) if len(x)))
    finally:
        files.finish(fd, path, sync)
    if pos != size:
        raise IntegrityError(f"rank {rank} step {step}: the store's chunks do not cover its entries ({pos} bytes "
                             f"written, {size} laid out); this step is not flushed")
    for row, c in zip(rows, crcs):
        row[CRC] = c
    side = {"rank": rank, "step": step, "file": name, "file_bytes": pos, "file_crc": whole, "items": rows,
            "group": group_of(manifest), "snapshot": mf.encode(manifest).decode("ascii"), "pieces": pieces}
    files.put(sidecar(ckpt, rank), mf.encode(side, RANK_FORMAT), sync)
    return side


def read_sidecar(path: Path) -> dict[str, Any]:
    """A rank's sidecar, its own checksum verified (StoreError if torn, foreign or corrupt): sealed, or written
    before the seal (UNSEALED_FORMAT; hpcft.durable.seal says what that means)."""
    data = read_file(path)
    try:
        return mf.decode(data, path, RANK_FORMAT)
    except StoreError as first:
        try:
            return mf.decode(data, path, UNSEALED_FORMAT)
        except StoreError:
            raise first from None
