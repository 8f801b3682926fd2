"""The per-job secret that proves a peer belongs to this job: 32 random bytes in a 0600 file of ours."""
from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from hpcft.errors import ConfigError

ENV_SECRET = "HPCFT_SECRET_FILE"
NAME = "secret"


def create(directory: str | os.PathLike) -> Path:
    """Write a fresh secret to `<directory>/secret` (exclusive create, 0600) and return its path.
    The supervisor calls this once per job; a secret already there is kept (a relaunch reuses it)."""
    path = Path(directory) / NAME
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        load(path)  # refuses a foreign or open one
        return path
    try:
        os.write(fd, secrets.token_hex(32).encode())
    finally:
        os.close(fd)
    return path


def load(path: str | os.PathLike | None = None) -> bytes:
    """Read the job secret from `path` (default $HPCFT_SECRET_FILE); ConfigError if it is missing, not a
    regular file of ours, readable by others, or too short."""
    where = path or os.environ.get(ENV_SECRET)
    if not where:
        raise ConfigError(f"no job secret: pass its path or set {ENV_SECRET} (the supervisor creates it)")
    try:
        fd = os.open(where, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"cannot open job secret {where}: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise ConfigError(f"refusing job secret {where}: it must be a regular file owned by you with mode "
                              f"0600 (found uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})")
        data = os.read(fd, 4096).strip()
    finally:
        os.close(fd)
    if len(data) < 32:
        raise ConfigError(f"job secret {where} is too short ({len(data)} bytes); remove it and relaunch")
    return data
