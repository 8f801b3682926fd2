"""Make a durable checkpoint visible: once every rank's data and sidecar are in its temporary directory, write DCP's
`.metadata` and hpcft's index, sync, and rename the directory to `step-<s>` (a reader sees all of it or nothing)."""
from __future__ import annotations

import io
import logging
import math
import os
import pickle
import time
from pathlib import Path
from typing import Any

from hpcft import events
from hpcft.durable import catalog, files, seal
from hpcft.durable.flush import (CRC, DATA, DTYPE, ENTRY, FQN, LENGTH, NBYTES, OFFSETS, RECORD, SHAPE,  # noqa: F401
                                 SIZES, read_sidecar, sidecar, sidecar_dir)
from hpcft.errors import StoreError
from hpcft.store import manifest as mf

GROUPS_FILE = "__optim_groups.distcp"


def sidecars(tmp: Path, world: int) -> dict[int, dict[str, Any]]:
    """rank → sidecar for every rank of `world`; StoreError naming the first one missing or unreadable."""
    out = {}
    for r in range(world):
        path = sidecar(tmp, r)
        if not path.exists():
            raise StoreError(f"the flush of {tmp.name} has no sidecar of rank {r}: not every rank was written")
        out[r] = read_sidecar(path)
    return out


def chunks_by_fqn(sides: dict[int, dict[str, Any]]) -> tuple[dict[str, list[tuple[int, list]]], list[str]]:
    """fqn → [(rank, row)] of the chunks DCP's metadata lists, and the fqns whose chunks overlap (several ranks
    hold the same name with their own content, e.g. tensor parallelism without DTensors): for those only the
    lowest rank's chunks are listed, so a DCP reader gets rank 0's tensor (hpcft's own reader uses each rank's)."""
    rows: dict[str, list[tuple[int, list]]] = {}
    for r in sorted(sides):
        for row in sides[r]["items"]:
            rows.setdefault(row[FQN], []).append((r, row))
    ambiguous = []
    for name, got in rows.items():
        volume = sum(math.prod(row[SIZES]) for _, row in got)
        if volume != math.prod(got[0][1][SHAPE]) or len({tuple(row[OFFSETS]) for _, row in got}) != len(got):
            first = got[0][0]
            rows[name] = [(r, row) for r, row in got if r == first]
            ambiguous.append(name)
    return rows, ambiguous


def _param_groups(meta: dict[str, Any]) -> dict[str, Any]:
    """`optim.param_groups.<i>.<key>` → value, as get_optimizer_state_dict names them (params by their fqns)."""
    from hpcft.snapshot.state import unjson

    optim = meta.get("optim") or {}
    names = optim.get("group_params") or []
    out = {}
    for i, group in enumerate(optim.get("param_groups") or []):
        for k, v in group.items():
            out[f"optim.param_groups.{i}.{k}"] = unjson(v)
        if i < len(names):
            out[f"optim.param_groups.{i}.params"] = list(names[i])
    return out


def prepare() -> None:
    """Import what `dcp_metadata` needs (~2 CPU-s the first time) where the caller chooses: the node agents, on their
    flush thread rather than that of their collective rounds."""
    from torch.distributed.checkpoint import filesystem, metadata  # noqa: F401


def dcp_metadata(tmp: Path, sides: dict[int, dict[str, Any]], rows: dict[str, list[tuple[int, list]]]) -> bytes:
    """DCP's `.metadata` (a pickled Metadata, as FileSystemWriter writes it) for the chunks in `rows`; the optimizer's
    param groups (rank 0's) are written to GROUPS_FILE as DCP byte items."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, StorageMeta, TensorProperties,
                                                       TensorStorageMetadata)

    state: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, tuple] = {}
    for name, got in rows.items():
        first = got[0][1]
        chunks = []
        for i, (r, row) in enumerate(got):
            offsets = torch.Size(row[OFFSETS])
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(row[SIZES])))
            storage[MetadataIndex(name, offsets, i)] = _StorageInfo(sides[r]["file"], row[RECORD], row[LENGTH])
        state[name] = TensorStorageMetadata(TensorProperties(dtype=getattr(torch, first[DTYPE])),
                                            torch.Size(first[SHAPE]), chunks)
        kind, _, rest = name.partition(".")
        planner[name] = ("optim", "state", *rest[len("state."):].rsplit(".", 1)) if kind == "optim" else (kind, rest)
    groups = _param_groups(seal.meta(sides[min(sides)], sidecar(tmp, min(sides))))
    if groups:
        path = tmp / GROUPS_FILE
        fd = files.create(path)
        pos = 0
        try:
            for name, value in groups.items():
                buf = io.BytesIO()
                torch.save(value, buf)
                n = files.write_all(fd, buf.getvalue(), path)
                state[name] = BytesStorageMetadata()
                storage[MetadataIndex(name)] = _StorageInfo(GROUPS_FILE, pos, n)
                _, _, i, key = name.split(".", 3)
                planner[name] = ("optim", "param_groups", int(i), key)
                pos += n
        finally:
            files.finish(fd, path)
    md = Metadata(state_dict_metadata=state, planner_data=planner, storage_data=storage,
                  storage_meta=StorageMeta(checkpoint_id=str(tmp.parent), save_id=tmp.name), version="1.0.0")
    return pickle.dumps(md)


def commit(tmp: Path, root: Path, step: int, world: int, job: str, keep: int) -> catalog.Durable:
    """Publish the flush in `tmp` as `root/step-<step>` and prune to the newest `keep`. A complete checkpoint of the
    step already there is kept, the new copy discarded: nothing durable is ever replaced. StoreError if a rank is
    missing or a file cannot be written (the previous ones stay)."""
    final = root / catalog.final_name(step)
    if final.exists():
        catalog.prune(root, keep, job)  # the copy in `tmp` is this job's and not current: removed
        events.emit("durable_exists", level=logging.WARNING, step=step, path=str(final))
        return catalog.Durable(step, final, catalog.read_index(final))
    sides = sidecars(tmp, world)
    rows, ambiguous = chunks_by_fqn(sides)
    if ambiguous:
        events.emit("durable_ambiguous", level=logging.WARNING, step=step, names=",".join(sorted(ambiguous)[:20]),
                    count=len(ambiguous), reason="several ranks hold these names with their own content (no DTensor "
                    "placement): DCP readers get rank 0's; hpcft restores each rank's own")
    metadata = dcp_metadata(tmp, sides, rows)
    index = {"step": step, "world": world, "job": job, "time": time.time(), "ranks": sorted(sides),
             "files": [s["file"] for _, s in sorted(sides.items())], "ambiguous": sorted(ambiguous),
             "bytes": sum(s["file_bytes"] for s in sides.values()), "sealed": all(map(seal.sealed, sides.values()))}
    files.put(sidecar_dir(tmp) / catalog.INDEX, mf.encode(index, catalog.CKPT_FORMAT))
    files.put(tmp / ".metadata", metadata)
    files.sync_dir(sidecar_dir(tmp))
    files.sync_dir(tmp)
    with files.failing(f"cannot publish {tmp} as {final}"):
        os.rename(tmp, final)
    files.sync_dir(root)
    catalog.prune(root, keep, job)
    return catalog.Durable(step, final, index)
