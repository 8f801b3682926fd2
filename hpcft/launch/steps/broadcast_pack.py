"""`hpcft run --broadcast-env`, the batch host's half: the environment's files (the venv or conda env at sys.prefix,
and a venv's base interpreter when on a network file system; editable sources and PYTHONPATH stay shared), their
content key, and the archive: a plain tar, written once per key into the cache, atomically, with its crc32c."""
from __future__ import annotations

import ast
import contextlib
import hashlib
import json
import os
import stat
import sys
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hpcft.errors import ConfigError
from hpcft.store.checksum import crc32c

FORMAT = 1  # the archive's layout (env/, base/); part of the key, so an archive of another layout is never reused
NETWORK_FS = frozenset({"nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "dvs", "ceph", "panfs", "wekafs",
                        "orangefs", "9p", "fuse.sshfs", "fuse.gcsfuse", "afs"})
SKIPPED = ("__pycache__",)  # not in the key (written by imports, validated against their sources), but packed


@dataclass(frozen=True)
class EnvSpec:
    """What is packed: `prefix` (sys.prefix) as env/, `base` (a venv's base prefix) as base/ when it is broadcast too;
    `python`: the interpreter's path under prefix; `editable`: source trees that stay where they are."""

    prefix: Path
    python: str
    base: Path | None = None
    editable: tuple[str, ...] = ()


@dataclass(frozen=True)
class Archive:
    """A packed environment in the cache: its path, content key, size, crc32c, and whether it was reused."""

    path: Path
    key: str
    bytes: int
    crc: int
    reused: bool
    seconds: float = 0.0


def fs_type(path: str | os.PathLike, mountinfo: str) -> str:
    """The file system type of the mount holding `path`, from /proc/self/mountinfo's text (pure)."""
    best, kind = "", "?"
    target = os.path.abspath(path)
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, rest = left.split(), right.split()
        if len(fields) < 5 or not rest:
            continue
        point = fields[4].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, rest[0]
    return kind


def _mountinfo() -> str:
    try:
        return Path("/proc/self/mountinfo").read_text()
    except OSError:
        return ""


def editable_roots(site_packages: Path) -> tuple[str, ...]:
    """The source trees editable installs point at: .pth directories and setuptools' `__editable__` finders' MAPPING."""
    roots: list[str] = []
    for pth in sorted(site_packages.glob("*.pth")):
        for line in pth.read_text(errors="replace").splitlines():
            line = line.strip()
            if line and not line.startswith(("#", "import ")) and os.path.isdir(line):
                roots.append(os.path.abspath(line))
    for finder in sorted(site_packages.glob("__editable__*finder.py")):
        for node in ast.parse(finder.read_text(errors="replace")).body:
            target = getattr(node, "target", None) or (node.targets[0] if isinstance(node, ast.Assign) else None)
            if getattr(target, "id", None) == "MAPPING" and node.value is not None:
                with contextlib.suppress(ValueError):
                    roots.extend(str(v) for v in ast.literal_eval(node.value).values())
    return tuple(dict.fromkeys(roots))


def describe(executable: str = sys.executable, prefix: str = sys.prefix, base_prefix: str = sys.base_prefix,
             mountinfo: str | None = None) -> EnvSpec:
    """The environment of the interpreter `executable` (default: this one); ConfigError when it is not a venv or a
    conda env (a system interpreter's packages are spread over the node's image and the user's home)."""
    root = Path(prefix)
    venv, conda = (root / "pyvenv.cfg").is_file(), (root / "conda-meta").is_dir()
    if not (venv or conda):
        raise ConfigError(f"--broadcast-env packs a virtual environment or a conda environment; {prefix} is neither "
                          "(sys.prefix of the interpreter hpcft run was started with): run hpcft from a venv or a "
                          "conda env, or drop --broadcast-env")
    python = os.path.relpath(os.path.abspath(executable), root)
    if python.startswith(".."):
        raise ConfigError(f"--broadcast-env: the interpreter {executable} is not inside its environment {prefix}")
    info = _mountinfo() if mountinfo is None else mountinfo
    base = Path(base_prefix) if venv and base_prefix != prefix and fs_type(base_prefix, info) in NETWORK_FS else None
    site = [Path(p) for p in sys.path if p.startswith(str(root)) and p.endswith("site-packages")]
    editable = tuple(r for s in site if s.is_dir() for r in editable_roots(s))
    return EnvSpec(root, python, base, editable)


def _entries(root: Path) -> Iterator[tuple[str, str]]:
    """(relative path, what identifies its content) for everything under `root`, in a stable order."""
    stack = [root]
    while stack:
        here = stack.pop()
        try:
            items = sorted(os.scandir(here), key=lambda e: e.name)
        except OSError:
            continue
        for item in items:
            rel = os.path.relpath(item.path, root)
            st = item.stat(follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                yield rel, "l " + os.readlink(item.path)
            elif stat.S_ISDIR(st.st_mode):
                if item.name not in SKIPPED:
                    yield rel, f"d {st.st_mode:o}"
                    stack.append(Path(item.path))
            else:
                yield rel, f"f {st.st_mode:o} {st.st_size} {st.st_mtime_ns}"


def content_key(spec: EnvSpec) -> str:
    """A name for the content: each file's path, mode, size and mtime, not its bytes (gigabytes to read per launch)."""
    digest = hashlib.sha256(json.dumps([FORMAT, str(spec.prefix), spec.python, str(spec.base)]).encode())
    for root in (spec.prefix, spec.base):
        if root is not None:
            for rel, what in _entries(root):
                digest.update(f"{rel}\0{what}\n".encode())
    return digest.hexdigest()[:20]


class _CrcWriter:
    """A write-only file that keeps the crc32c and size of what passes through."""

    def __init__(self, f):
        self.f, self.crc, self.size = f, 0, 0

    def write(self, data: bytes) -> int:
        self.crc, self.size = crc32c(data, self.crc), self.size + len(data)
        return self.f.write(data)


def pack(spec: EnvSpec, cache: Path, key: str | None = None) -> Archive:
    """The archive of `spec` in `cache` (env-<key>.tar and its .json): reused when one of this key is complete, else
    written to a temporary name and renamed, so that an interrupted pack never leaves an archive to be reused."""
    key = key or content_key(spec)
    path, meta = cache / f"env-{key}.tar", cache / f"env-{key}.json"
    try:
        known = json.loads(meta.read_text())
        if path.stat().st_size == known["bytes"]:
            return Archive(path, key, known["bytes"], known["crc"], True)
    except (OSError, ValueError, KeyError):
        pass
    cache.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with open(tmp, "wb") as f:
        out = _CrcWriter(f)
        with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            tar.add(spec.prefix, arcname="env")
            if spec.base is not None:
                tar.add(spec.base, arcname="base")
    os.replace(tmp, path)
    tmp_meta = meta.with_name(f".{meta.name}.{os.getpid()}")
    tmp_meta.write_text(json.dumps({"bytes": out.size, "crc": out.crc, "prefix": str(spec.prefix)}))
    os.replace(tmp_meta, meta)
    return Archive(path, key, out.size, out.crc, False, round(time.monotonic() - started, 3))
