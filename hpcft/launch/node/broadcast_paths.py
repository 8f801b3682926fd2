"""`hpcft run --broadcast-env`'s names, shared by the supervisor, the node step, the janitors and the task wrapper
(pure): where a node's copy lives, what the broadcast archive is called there, the interpreter chooser every hpcft step
starts through, and the trainers' command pointed at the broadcast interpreter."""
from __future__ import annotations

import os
import shlex
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

from hpcft.env import NVME_ENV, expand_vars

ENV_NODE_DIR = "HPCFT_BROADCAST_NODE_DIR"  # a node's copy (the same path on every node): the janitors remove it
ENV_SHARED = "HPCFT_BROADCAST_SHARED"  # the shared-FS interpreter: a trainer command naming it runs the broadcast one
DEFAULT_DIR = "/tmp"  # without $HPCFT_NVME (Frontier: /mnt/bb/$USER with `hpcft submit --nvme`)


def broadcast_root(given: str | None, environ: Mapping[str, str]) -> Path:
    """Where copies go: --broadcast-dir, else $HPCFT_NVME, else /tmp, expanded here: sbcast writes one path on all
    nodes."""
    return Path(expand_vars(given or environ.get(NVME_ENV) or DEFAULT_DIR, environ))


def node_dir(root: Path, user: str, job: str) -> Path:
    """A node's copy of the environment: env/ (and base/), and ok-<key> once verified."""
    return root / f"hpcft-env-{user}-{job}"


def archive_dest(root: Path, user: str, job: str) -> Path:
    """Where sbcast puts the archive on every node (removed once unpacked)."""
    return root / f"hpcft-env-{user}-{job}.tar"


def probe_name(root: Path, user: str, job: str, node: str) -> Path:
    """The file each node's task creates first: a node that sees another node's says the root is not node-local."""
    return root / f".hpcft-env-{user}-{job}.node-{node}"


def ok_marker(node: Path, key: str) -> Path:
    return node / f"ok-{key}"


def broadcast_python(node: Path, python: str) -> Path:
    """The interpreter in a node's copy; `python`: its path under the environment's prefix (e.g. bin/python)."""
    return node / "env" / python


def chooser(node: Path, key: str, python: str, shared: str) -> str:
    """The chooser: the node's verified copy, else the shared interpreter (one shared file, not an import's many)."""
    q = shlex.quote
    return ("#!/bin/sh\n# hpcft run --broadcast-env: this node's verified copy of the environment, else the shared\n"
            f"[ -e {q(str(ok_marker(node, key)))} ] && exec {q(str(broadcast_python(node, python)))} \"$@\"\n"
            f"exec {q(shared)} \"$@\"\n")


def localized(command: Sequence[str], environ: Mapping[str, str], python: str) -> list[str]:
    """`command` running `python` (this copy) where it names the shared interpreter: `python train.py` runs the copy."""
    from hpcft.launch.node.zygote import same_interpreter

    shared = environ.get(ENV_SHARED)
    if not command or not shared or same_interpreter(python, shared):
        return list(command)
    exe = command[0] if os.sep in command[0] else shutil.which(command[0], path=environ.get("PATH"))
    return [python, *command[1:]] if exe and same_interpreter(exe, shared) else list(command)
