"""Write one rank's snapshot of one step into a durable checkpoint directory: its chunks as torch.save records
(`__<rank>_0.distcp`, read by plain `dcp.load`) straight from the store, and a JSON sidecar
(`.hpcft/rank-<rank>.json`) listing each chunk with its place and a crc32c carried over from the store's chunk
checksums (see hpcft.durable.crc): hpcft reads a durable checkpoint back without unpickling anything."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from hpcft import events
from hpcft.durable import crc, files, items
from hpcft.durable.envelope import envelope
from hpcft.errors import IntegrityError
from hpcft.store import crc32c, seal, seal_key
from hpcft.store import manifest as mf
from hpcft.store.paths import read_file

RANK_FORMAT = "hpcft-durable-rank/1"
META = ("rng", "extra", "optim", "world", "job_id", "writer", "time")  # what a restore applies besides tensors


def sidecar_dir(ckpt: Path) -> Path:
    return ckpt / ".hpcft"


def data_name(rank: int) -> str:
    return f"__{rank}_0.distcp"


def item_crcs(data: np.ndarray, chunks: Sequence[Sequence[int]], its: Sequence[items.Item], key: int,
              rank: int = -1, step: int = -1) -> list[int]:
    """crc32c of every item's bytes, derived from the sub-range crcs that reproduce each store chunk's sealed
    checksum; IntegrityError (event `chunk_lost`) at the first chunk whose bytes do not match the store's record."""
    out = [0] * len(its)
    j = 0
    for lo, n, recorded in chunks:
        hi, pos, run = lo + n, lo, 0
        while pos < hi:
            while j < len(its) and its[j].src + its[j].nbytes <= pos:
                j += 1
            inside = j < len(its) and its[j].src <= pos
            end = min(hi, its[j].src + its[j].nbytes) if inside else min(hi, its[j].src if j < len(its) else hi)
            c = crc32c(data[pos:end])
            run = c if pos == lo else crc.combine(run, c, end - pos)
            if inside:
                out[j] = crc.combine(out[j], c, end - pos)
            pos = end
        if seal(run, key) != recorded:
            events.emit("chunk_lost", level=logging.ERROR, rank=rank, step=step, offset=lo, reason="durable flush")
            raise IntegrityError(f"rank {rank} step {step}: the store's chunk at offset {lo} fails its crc32c; "
                                 "this step is not flushed")
    return out


def write_rank(manifest: dict[str, Any], data: np.ndarray, ckpt: Path, *, pace: Callable[[int], None] | None = None,
               sync: bool = True) -> dict[str, Any]:
    """Write the rank's chunks and sidecar into `ckpt` (which exists); the sidecar's content. Every store chunk is
    verified before anything of it is trusted; an IntegrityError or StoreError leaves a partial file that the
    checkpoint's commit never sees (it commits only when every rank's sidecar is there)."""
    rank, step = int(manifest["rank"]), int(manifest["step"])
    its = items.of_manifest(manifest)
    crcs = item_crcs(data, manifest["chunks"], its, seal_key(manifest), rank, step)
    name = data_name(rank)
    path = ckpt / name
    fd = files.create(path)
    rows, pos = [], 0
    try:
        for it, c in zip(its, crcs):
            prefix, suffix = envelope(it.dtype, it.sizes)
            files.write_all(fd, prefix, path)
            files.write_all(fd, data[it.src:it.src + it.nbytes], path, pace)
            files.write_all(fd, suffix, path)
            length = len(prefix) + it.nbytes + len(suffix)
            rows.append([it.fqn, it.entry, it.dtype, list(it.shape), list(it.offsets), list(it.sizes),
                         pos + len(prefix), it.nbytes, c, pos, length])
            pos += length
    finally:
        files.finish(fd, path, sync)
    # the data-parallel group whose shares tile the replicated tensors: where hpcft's reader finds the rest of them
    group = (manifest.get("share") or {}).get("group") or [rank]
    side = {"rank": rank, "step": step, "file": name, "file_bytes": pos, "items": rows, "group": list(group),
            "meta": {k: manifest.get(k) for k in META}}
    files.put(sidecar_dir(ckpt) / f"rank-{rank:05d}.json", mf.encode(side, RANK_FORMAT), sync)
    return side


def read_sidecar(path: Path) -> dict[str, Any]:
    """A rank's sidecar, verified (StoreError if torn, foreign or corrupt)."""
    return mf.decode(read_file(path), path, RANK_FORMAT)
