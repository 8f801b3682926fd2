"""`hpcft export`: a complete durable checkpoint out of a persist directory as one file tree (a DCP checkpoint: hard
links where the file system allows, else copies) or one file (`torch.save` of the full {"model", "optim"} state
dict, assembled by hpcft's reader). Every chunk's crc32c is verified first; nothing existing is ever overwritten."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from hpcft.durable import boxes, catalog, commit, files
from hpcft.durable.boxes import Box
from hpcft.durable.reader import Checkpoint, fill
from hpcft.errors import ConfigError, StoreError

FORMATS = catalog.EXPORT_FORMATS


def pick(root: Path, step: int | None = None) -> catalog.Durable:
    """The newest complete checkpoint under `root`, or the one of `step`; ConfigError naming what is there."""
    if not root.is_dir():
        raise ConfigError(f"persist directory {root} does not exist; pass --from DIR (or set "
                          f"{catalog.ENV_PERSIST})")
    found = {c.step: c for c in catalog.checkpoints(root)}
    if not found:
        raise ConfigError(f"{root} holds no complete durable checkpoint")
    if step in found or step is None:
        return found[max(found) if step is None else step]
    raise ConfigError(f"{root} holds no complete checkpoint of step {step}; it holds steps "
                      f"{', '.join(map(str, found))}")


def _fresh(dest: Path) -> None:
    if dest.is_symlink() or (dest.exists() and (not dest.is_dir() or any(dest.iterdir()))):
        raise ConfigError(f"{dest} exists and is not an empty directory: export never overwrites; choose a new path")


def verify(ckpt: Checkpoint, data: bool = True) -> int:
    """Check every rank's sidecar against its seal (ManifestError) and, with `data`, read every chunk and check its
    crc32c (IntegrityError at the first that fails); bytes read."""
    for r in range(ckpt.world):
        for row in ckpt.side(r)["items"]:
            if data:
                ckpt.read(r, row)
    return ckpt.nbytes


def _link_or_copy(src: Path, dst: Path, linked: list[bool]) -> None:
    try:
        if linked[0]:
            os.link(src, dst)
            return
    except OSError:
        linked[0] = False  # another file system, or links refused: copy from here on
    shutil.copyfile(src, dst)


def export_dcp(durable: catalog.Durable, dest: Path) -> bool:
    """Put `durable` at `dest` (new, or an empty directory) as a DCP checkpoint with hpcft's sidecars, built beside it
    and renamed into place; True if hard-linked, False if copied."""
    _fresh(dest)
    tmp = dest.with_name(f".{dest.name}.export-{os.getpid()}.tmp")
    linked = [True]
    try:
        tmp.mkdir(mode=0o700, parents=True)
        names = sorted(p.relative_to(durable.path) for p in durable.path.rglob("*") if p.is_file())
        names.sort(key=lambda p: p.name == ".metadata")  # the checkpoint is one when .metadata is there
        for rel in names:
            (tmp / rel).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            _link_or_copy(durable.path / rel, tmp / rel, linked)
        if dest.is_dir():
            dest.rmdir()  # empty (checked above); a concurrent writer makes this fail, never lose its files
        os.rename(tmp, dest)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise StoreError(f"cannot export {durable.path} to {dest}: {exc.strerror or exc}") from exc
    return linked[0]


def full_state(ckpt: Checkpoint) -> dict[str, Any]:
    """The unsharded state dict, as `get_state_dict(..., full_state_dict=True)` gives it (a name several ranks saved
    with their own content: the lowest rank's, as a DCP reader gets)."""
    from hpcft.snapshot.state import unjson

    rows, _ = ckpt.every()
    model: dict[str, Any] = {}
    optim_state: dict[str, dict[str, Any]] = {}
    for name, got in rows.items():
        row = got[0][0][1]
        t = torch.empty(row[commit.SHAPE], dtype=getattr(torch, row[commit.DTYPE]))
        parts = boxes.parts(Box((0,) * t.dim(), tuple(t.shape)), got)
        if parts is None:
            raise StoreError(f"{ckpt.path}: the chunks of {name} do not tile it")
        fill(t, parts, ckpt)
        kind, _, rest = name.partition(".")
        if kind == "optim":
            param, _, key = rest[len("state."):].rpartition(".")
            optim_state.setdefault(param, {})[key] = t
        else:
            model[rest] = t
    meta = ckpt.side(0)["meta"].get("optim") or {}
    for k, v in (meta.get("scalars") or {}).items():
        param, _, key = k.rpartition("/")
        optim_state.setdefault(param, {})[key] = unjson(v)
    names = meta.get("group_params") or []
    groups = [{**{k: unjson(v) for k, v in g.items()}, "params": list(names[i]) if i < len(names) else []}
              for i, g in enumerate(meta.get("param_groups") or [])]
    return {"model": model, "optim": {"state": optim_state, "param_groups": groups}}


def export_torch(durable: catalog.Durable, dest: Path) -> int:
    """One `torch.save` file of `full_state` at `dest` (which must not exist), written beside it and renamed; the
    number of sidecars read that were written before the seal."""
    if dest.exists() or dest.is_symlink():
        raise ConfigError(f"{dest} exists: export never overwrites; choose a new file name")
    ckpt = Checkpoint(durable)
    try:
        state = full_state(ckpt)
    finally:
        ckpt.close()
    tmp = dest.with_name(f".{dest.name}.export-{os.getpid()}.tmp")
    try:
        with files.failing(f"cannot write {dest}"):
            torch.save(state, tmp)
            os.link(tmp, dest)  # fails if someone created `dest` meanwhile: nothing is overwritten
    finally:
        tmp.unlink(missing_ok=True)
    return ckpt.unsealed


def export(root: Path, dest: Path, fmt: str = "dcp", step: int | None = None, check: bool = True) -> dict[str, Any]:
    """Export the newest (or `step`'s) complete checkpoint under `root` to `dest` in `fmt`; what was done."""
    if fmt not in FORMATS:
        raise ConfigError(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")
    durable = pick(root, step)
    out: dict[str, Any] = {"step": durable.step, "from": str(durable.path), "to": str(dest), "format": fmt}
    if fmt == "torch":
        out["unsealed"] = export_torch(durable, dest)  # the reader verifies every sidecar and chunk it assembles
        return out
    _fresh(dest)
    ckpt = Checkpoint(durable)
    try:
        verified = verify(ckpt, data=check)  # the sidecars' seals always: they cost no data read
    finally:
        ckpt.close()
    if check:
        out["verified_bytes"] = verified
    out["unsealed"] = ckpt.unsealed
    out["linked"] = export_dcp(durable, dest)
    return out
