"""The durable tier's first level: node-local storage (Frontier: the NVMe at /mnt/bb/$USER). An agent writes its
node's ranks of a flush there (the store is released sooner), publishes them as that node's `step-<s>/` (index
`.hpcft/local.json`), then drains them to the persist directory, where slot 0 commits the checkpoint as before. A
restore reads them through hpcft's durable reader, with other nodes' ranks from the shared copy."""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Mapping

from hpcft import events
from hpcft.durable import catalog, files
from hpcft.durable.commit import CRC, DATA, LENGTH, NBYTES, RECORD
from hpcft.durable.flush import RANK_FORMAT, data_name, read_sidecar, sidecar, sidecar_dir
from hpcft.env import expand_vars, nvme_dir
from hpcft.errors import IntegrityError, StoreError
from hpcft.store import crc32c
from hpcft.store import manifest as mf
from hpcft.store.paths import read_file

ENV_LOCAL = "HPCFT_PERSIST_LOCAL"  # the node-local level's directory, as `hpcft run --persist-local` exports it
UNDER_NVME = "hpcft-persist"  # the level's directory under $HPCFT_NVME when no other is given
LOCAL_INDEX = "local.json"
LOCAL_FORMAT = "hpcft-durable-local/1"


def local_root(given: str | None = None, environ: Mapping[str, str] | None = None) -> Path | None:
    """This node's first level: `given`, else $HPCFT_PERSIST_LOCAL, else $HPCFT_NVME/hpcft-persist when that exists;
    None for none (`none` turns it off). Variables in the value are expanded on the node."""
    env = os.environ if environ is None else environ
    value = given if given is not None else env.get(ENV_LOCAL) or None
    if value is not None:
        return None if value.lower() == "none" else Path(expand_vars(value, env))
    nvme = nvme_dir(env)
    return Path(nvme) / UNDER_NVME if nvme else None


def copies(root: Path | None, persist: Path | None = None) -> list[catalog.Durable]:
    """This node's published copies under `root`, oldest first (but those of another persist directory)."""
    out = []
    for step, d in catalog.step_dirs(root):
        try:
            index = mf.decode(read_file(sidecar_dir(d) / LOCAL_INDEX), d, LOCAL_FORMAT)
        except StoreError:
            continue  # a copy being replaced, or torn by a crash: never read
        if index.get("step") == step and (persist is None or index.get("persist") == _key(persist)):
            out.append(catalog.Durable(step, d, index))
    return out


def _key(persist: Path) -> str:
    """The persist directory as a copy records it (the same for a relative and an absolute spelling)."""
    return os.path.abspath(persist)


def publish(tmp: Path, root: Path, step: int, world: int, ranks: list[int], job: str, flush_id: str,
            persist: Path | None, keep: int) -> catalog.Durable:
    """Make the ranks written into `tmp` this node's copy `root/step-<step>` (replacing an older copy of the step: the
    first level is a cache of the store, not the record), and keep the newest `keep` copies."""
    index = {"step": step, "world": world, "ranks": sorted(ranks), "job": job, "flush": flush_id,
             "persist": _key(persist) if persist else None}
    files.put(sidecar_dir(tmp) / LOCAL_INDEX, mf.encode(index, LOCAL_FORMAT))
    files.sync_dir(sidecar_dir(tmp))
    final = root / catalog.final_name(step)
    old = root / catalog.tmp_name(step, f"{flush_id}-old")  # this job's temporary name: pruned if left by a crash
    with files.failing(f"cannot publish {tmp} as {final}"):
        if final.exists():
            os.rename(final, old)
        os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    files.sync_dir(root)
    catalog.prune(root, keep, job, listing=lambda r: copies(r))
    return catalog.Durable(step, final, index)


def usable(root: Path | None, persist: Path | None, rank: int, world: int,
           shared: Mapping[int, catalog.Durable]) -> dict[int, catalog.Durable]:
    """step → this node's copy rank `rank` can restore from: of the same world size, with this rank, and every rank of
    its data-parallel group either in the copy or in `shared` (the shared file system's complete checkpoints)."""
    out = {}
    for c in copies(root, persist):
        ranks = set(c.index.get("ranks") or ())
        if c.index.get("world") != world or rank not in ranks:
            continue
        try:
            group = read_sidecar(sidecar(c.path, rank)).get("group") or [rank]
        except StoreError:
            continue
        if set(group) <= ranks or c.step in shared:
            out[c.step] = c
    return out


def withdraw(root: Path | None, step: int, why: str) -> list[Path]:
    """Remove this node's copies newer than `step`, which a restore loaded (training writes those steps anew)."""
    gone = [c.path for c in copies(root) if c.step > step]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    if gone:
        events.emit("local_withdrawn", step=step, paths=",".join(p.name for p in gone), reason=why)
    return gone


def drain(copy: catalog.Durable, dest: Path, pace: Callable[[int], None] | None = None, sync: bool = True) -> int:
    """Copy this node's ranks from `copy` into the shared file system's flush directory `dest` (created if missing),
    each record checked against its sidecar's crc32c; the bytes copied. IntegrityError on a mismatch, StoreError on
    I/O."""
    files.make_dir(sidecar_dir(dest))
    total = 0
    for rank in copy.index["ranks"]:
        path = sidecar(copy.path, rank)
        raw = read_file(path)
        side = mf.decode(raw, path, RANK_FORMAT)  # verified before its file is copied
        total += _copy_file(copy.path / data_name(rank), dest / data_name(rank), side, pace, sync)
        files.put(sidecar(dest, rank), raw, sync)
    return total


def _copy_file(src: Path, dst: Path, side: dict[str, Any], pace: Callable[[int], None] | None, sync: bool) -> int:
    """One rank's data file, record by record (they tile the file back to back), each record's data verified."""
    rows = sorted(side["items"], key=lambda r: r[RECORD])
    pos = 0
    for row in rows:
        if row[RECORD] != pos:
            raise StoreError(f"{src}'s sidecar does not tile the file at byte {pos}")
        pos += row[LENGTH]
    with files.failing(f"cannot open {src}"):
        fd_in = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if os.fstat(fd_in).st_size != pos or pos != side.get("file_bytes"):
            raise StoreError(f"{src} has {os.fstat(fd_in).st_size} bytes; its sidecar says {side.get('file_bytes')}")
        fd_out = files.create(dst)
        whole = 0
        try:
            for row in rows:
                whole = _copy_record(fd_in, fd_out, src, dst, row, pace, whole)
        finally:
            files.finish(fd_out, dst, sync)
    finally:
        os.close(fd_in)
    if side.get("file_crc", whole) != whole:  # the envelopes too: what DCP's reader unpickles
        events.emit("durable_chunk_lost", level=logging.ERROR, path=str(src), reason="drain of the node-local level")
        raise IntegrityError(f"{src} fails the crc32c its writer recorded for the whole file: not drained")
    return pos


def _copy_record(fd_in: int, fd_out: int, src: Path, dst: Path, row: list, pace: Callable[[int], None] | None,
                 whole: int) -> int:
    """Copy one record, its data checked against the row's crc32c; `whole`, the file's running crc32c, continued."""
    lo, hi = row[DATA], row[DATA] + row[NBYTES]
    pos, end, crc = row[RECORD], row[RECORD] + row[LENGTH], 0
    while pos < end:
        with files.failing(f"cannot read {src}"):
            buf = os.pread(fd_in, min(files.PIECE, end - pos), pos)
        if not buf:
            raise StoreError(f"{src} ends at byte {pos}")
        a, b = max(lo, pos), min(hi, pos + len(buf))
        if a < b:
            crc = crc32c(memoryview(buf)[a - pos:b - pos], crc)
        whole = crc32c(buf, whole)
        files.write_all(fd_out, buf, dst, pace)
        pos += len(buf)
    if crc != row[CRC]:
        events.emit("durable_chunk_lost", level=logging.ERROR, path=str(src), name=row[0], offset=row[DATA],
                    reason="drain of the node-local level")
        raise IntegrityError(f"the chunk of {row[0]} at byte {row[DATA]} of {src} fails its crc32c: not drained")
    return whole
