"""Write one rank's snapshot of one step into a durable checkpoint directory: its chunks as torch.save records
(`__<rank>_0.distcp`, read by plain `dcp.load`) straight from the store, and a JSON sidecar
(`.hpcft/rank-<rank>.json`) listing each chunk with its place and a crc32c carried over from the store's chunk
checksums (see hpcft.store.crcmath): hpcft reads a durable checkpoint back without unpickling anything."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from hpcft import events
from hpcft.durable import files, items
from hpcft.durable.envelope import envelope
from hpcft.errors import IntegrityError
from hpcft.store import crc32c, crcmath, seal, seal_key
from hpcft.store import manifest as mf
from hpcft.store.paths import read_file

RANK_FORMAT = "hpcft-durable-rank/1"
META = ("rng", "extra", "optim", "world", "job_id", "writer", "time")  # what a restore applies besides tensors


def sidecar_dir(ckpt: Path) -> Path:
    return ckpt / ".hpcft"


def data_name(rank: int) -> str:
    return f"__{rank}_0.distcp"


def _chunks_verified(data: np.ndarray, chunks: Sequence[Sequence[int]], its: Sequence[items.Item], key: int,
                     rank: int, step: int) -> Iterator[tuple[int, int, int | None, int]]:
    """Walk the store's chunks in order, cut at every item boundary: yield (start, end, item index or None, crc32c of
    the bytes) per sub-range, each chunk's sub-range crcs combined and checked against the store's sealed checksum
    before the next chunk is read; IntegrityError (event `chunk_lost`) at the first chunk that does not match."""
    j = 0
    for lo, n, recorded in chunks:
        hi, pos, run, parts = lo + n, lo, 0, []
        while pos < hi:
            while j < len(its) and its[j].src + its[j].nbytes <= pos:
                j += 1
            inside = j < len(its) and its[j].src <= pos
            end = min(hi, its[j].src + its[j].nbytes) if inside else min(hi, its[j].src if j < len(its) else hi)
            c = crc32c(data[pos:end])
            run = c if pos == lo else crcmath.combine(run, c, end - pos)
            parts.append((pos, end, j if inside else None, c))
            pos = end
        if seal(run, key) != recorded:
            events.emit("chunk_lost", level=logging.ERROR, rank=rank, step=step, offset=lo, reason="durable flush")
            raise IntegrityError(f"rank {rank} step {step}: the store's chunk at offset {lo} fails its crc32c; "
                                 "this step is not flushed")
        yield from parts  # verified: now written, while the chunk is still in the cache


def write_rank(manifest: dict[str, Any], data: np.ndarray, ckpt: Path, *, pace: Callable[[int], None] | None = None,
               sync: bool = True) -> dict[str, Any]:
    """Write the rank's chunks and sidecar into `ckpt` (which exists); the sidecar's content. One pass over the
    data: each store chunk is verified against its checksum, then its bytes are written; each item's crc32c is
    combined from the verified sub-ranges' (carried over, never computed from bytes read again). An IntegrityError
    or StoreError leaves a partial file that the checkpoint's commit never sees (it needs every rank's sidecar)."""
    rank, step = int(manifest["rank"]), int(manifest["step"])
    its = items.of_manifest(manifest)
    name = data_name(rank)
    path = ckpt / name
    crcs = [0] * len(its)
    starts = [0] * len(its)
    fd = files.create(path)
    pos = whole = 0  # whole: the file's crc32c, its data parts combined from the verified ones (for a drain's check)

    def put(*bufs: Any) -> None:
        nonlocal pos
        pos += files.write_all(fd, bufs[0], path, pace) if len(bufs) == 1 else files.write_many(fd, bufs, path, pace)

    try:
        for i, it in enumerate(its):
            if it.nbytes == 0:  # no sub-range reaches it
                starts[i] = pos
                record = b"".join(envelope(it.dtype, it.sizes))
                whole = crc32c(record, whole)
                put(record)
        for a, b, i, c in _chunks_verified(data, manifest["chunks"], its, seal_key(manifest), rank, step):
            if i is None:
                continue
            it = its[i]
            prefix, suffix = envelope(it.dtype, it.sizes)
            head = prefix if a == it.src else b""
            tail = suffix if b == it.src + it.nbytes else b""
            if head:
                starts[i] = pos
            crcs[i] = crcmath.combine(crcs[i], c, b - a)
            whole = crc32c(tail, crcmath.combine(crc32c(head, whole), c, b - a))
            put(*(x for x in (head, data[a:b], tail) if len(x)))
    finally:
        files.finish(fd, path, sync)
    rows = []
    for it, c, start in zip(its, crcs, starts):
        prefix, suffix = envelope(it.dtype, it.sizes)
        rows.append([it.fqn, it.entry, it.dtype, list(it.shape), list(it.offsets), list(it.sizes),
                     start + len(prefix), it.nbytes, c, start, len(prefix) + it.nbytes + len(suffix)])
    # the data-parallel group whose shares tile the replicated tensors: where hpcft's reader finds the rest of them
    group = (manifest.get("share") or {}).get("group") or [rank]
    side = {"rank": rank, "step": step, "file": name, "file_bytes": pos, "file_crc": whole, "items": rows,
            "group": list(group),
            "meta": {k: manifest.get(k) for k in META}}
    files.put(sidecar_dir(ckpt) / f"rank-{rank:05d}.json", mf.encode(side, RANK_FORMAT), sync)
    return side


def read_sidecar(path: Path) -> dict[str, Any]:
    """A rank's sidecar, verified (StoreError if torn, foreign or corrupt)."""
    return mf.decode(read_file(path), path, RANK_FORMAT)
