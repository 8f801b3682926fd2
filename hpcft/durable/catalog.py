"""The durable checkpoints under a persist directory: `step-<s>/` is complete (renamed from its temporary
`.step-<s>.<id>.tmp/` only after every rank's data, the sidecars and DCP's `.metadata` were written and synced);
anything else is a flush in progress or a failed one, never read."""
from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hpcft import events
from hpcft.errors import StoreError
from hpcft.store import manifest as mf
from hpcft.store.paths import read_file

CKPT_FORMAT = "hpcft-durable/1"
INDEX = "checkpoint.json"  # in .hpcft/: the checkpoint's own description, written before .metadata
ENV_PERSIST = "HPCFT_PERSIST_DIR"  # the durable tier's directory, as `hpcft run` exports it to the trainers
EXPORT_FORMATS = ("dcp", "torch")  # `hpcft export --format` (here, not in export.py: the CLI must not import torch)
DONE = re.compile(r"step-(\d{1,12})$")
_TMP = re.compile(r"\.step-(\d{1,12})\.([A-Za-z0-9_.-]+)\.tmp$")


@dataclass(frozen=True)
class Durable:
    """A complete durable checkpoint: its step, directory and index (`.hpcft/checkpoint.json`)."""
    step: int
    path: Path
    index: dict[str, Any]


def persist_root(given: str | os.PathLike | None = None) -> Path | None:
    """The durable tier's directory: `given`, else $HPCFT_PERSIST_DIR, else None (no durable tier)."""
    value = given if given is not None else os.environ.get(ENV_PERSIST) or None
    return Path(value) if value is not None else None


def tmp_name(step: int, flush_id: str) -> str:
    return f".step-{step}.{flush_id}.tmp"


def temporaries(root: Path) -> set[str]:
    """The names of the flushes' temporary directories in `root`: flushes under way, or failed ones not pruned yet."""
    try:
        return {d.name for d in os.scandir(root) if _TMP.match(d.name)}
    except FileNotFoundError:
        return set()


def final_name(step: int) -> str:
    return f"step-{step}"


def read_index(path: Path) -> dict[str, Any]:
    """A checkpoint's index, verified (StoreError if missing, torn or foreign)."""
    return mf.decode(read_file(path / ".hpcft" / INDEX), path / ".hpcft" / INDEX, CKPT_FORMAT)


def step_dirs(root: Path | None) -> list[tuple[int, Path]]:
    """(step, directory) of every `step-<s>/` directory under `root` (no symlink), oldest first."""
    if root is None or not root.is_dir():
        return []
    found = [(int(m.group(1)), d) for d in root.iterdir()
             if (m := DONE.match(d.name)) and not d.is_symlink() and d.is_dir()]
    return sorted(found, key=lambda f: f[0])


def checkpoints(root: Path | None) -> list[Durable]:
    """The complete checkpoints under `root`, oldest first (a directory without a valid index or `.metadata` is
    reported once per call as `durable_bad` and skipped)."""
    out = []
    for step, d in step_dirs(root):
        try:
            index = read_index(d)
            if not (d / ".metadata").is_file() or index.get("step") != step:
                raise StoreError(f"{d} has no .metadata or its index is for step {index.get('step')}")
        except StoreError as exc:
            events.emit("durable_bad", level=logging.WARNING, path=str(d), error=str(exc))
            continue
        out.append(Durable(step, d, index))
    return out


def newest(root: Path | None) -> Durable | None:
    found = checkpoints(root)
    return found[-1] if found else None


def prune(root: Path, keep: int, job: str, current: str | None = None,
          listing: Callable[[Path], list[Durable]] | None = None) -> list[Path]:
    """Remove complete checkpoints (as `listing` finds them: default `checkpoints`) beyond the newest `keep`, and this
    job's temporary directories other than `current` (failed flushes); the paths removed (event `durable_pruned`)."""
    done = (listing or checkpoints)(root)
    gone = [c.path for c in done[:max(0, len(done) - keep)]]
    for d in root.iterdir():
        m = _TMP.match(d.name)
        if m and m.group(2).startswith(f"{job}-") and m.group(2) != current and not d.is_symlink():
            gone.append(d)
    for d in gone:
        shutil.rmtree(d, ignore_errors=True)
    if gone:
        events.emit("durable_pruned", paths=",".join(p.name for p in gone))
    return gone
