"""File mechanics of the durable tier: exclusive creation (never through a symlink), full writes, fsync, an atomic
replace; every OSError becomes a StoreError that names the path."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from hpcft.errors import HpcftError, StoreError
from hpcft.store.paths import replace_file

PIECE = 16 << 20  # a large item is written (and paced) in pieces of this size


@contextlib.contextmanager
def failing(what: str, error: type[HpcftError] = StoreError) -> Iterator[None]:
    """An OSError in the block raises `error`: "<what>: <why>"."""
    try:
        yield
    except OSError as exc:
        raise error(f"{what}: {exc.strerror or exc}") from exc


def create(path: Path) -> int:
    """A new file of ours (0600); StoreError if anything already sits at `path`."""
    with failing(f"cannot create {path}"):
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def write_all(fd: int, buf: Any, path: Path, pace: Callable[[int], None] | None = None) -> int:
    """Write every byte of `buf` (bytes or a uint8 array) in pieces of at most PIECE, each paced by `pace(n)`."""
    view = memoryview(buf).cast("B")
    done = 0
    while done < len(view):
        n = min(PIECE, len(view) - done)
        if pace is not None:
            pace(n)
        with failing(f"cannot write {path}"):
            done += os.write(fd, view[done:done + n])
    return done


def write_many(fd: int, bufs: Sequence[Any], path: Path, pace: Callable[[int], None] | None = None) -> int:
    """Write buffers back to back with one writev where the kernel takes them whole (the rest by `write_all`)."""
    views = [memoryview(b).cast("B") for b in bufs]
    total = sum(len(v) for v in views)
    if pace is not None:
        pace(total)
    with failing(f"cannot write {path}"):
        skip = os.writev(fd, views)
    for v in views:  # a short writev: the rest one by one
        if skip >= len(v):
            skip -= len(v)
            continue
        write_all(fd, v[skip:], path)
        skip = 0
    return total


def finish(fd: int, path: Path, sync: bool = True) -> None:
    """fsync (when `sync`) and close a file written with `write_all`."""
    try:
        with failing(f"cannot fsync {path}"):
            if sync:
                os.fsync(fd)
    finally:
        os.close(fd)


def put(path: Path, data: bytes, sync: bool = True) -> None:
    """Write `data` to `path` atomically (store.paths.replace_file: a temporary file, fsync when `sync`, rename)."""
    with failing(f"cannot write {path}"):
        replace_file(path, data, path.with_name(f".{path.name}.{os.getpid()}.part"), sync=sync)


def sync_dir(path: Path) -> None:
    """fsync a directory, so that the names created or renamed in it survive a crash."""
    with failing(f"cannot open {path}"):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a directory; the rename is still atomic
    finally:
        os.close(fd)


def make_dir(path: Path) -> Path:
    """`path` as a directory of ours (0700 when created); StoreError if a file or a symlink sits there."""
    with failing(f"cannot create {path}"):
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.is_symlink() or not path.is_dir():
        raise StoreError(f"{path} is not a directory")
    return path
