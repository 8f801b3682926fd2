"""Where a job's snapshots live, and the checks that keep other users out of them."""
import getpass
import os
import re
import stat
from pathlib import Path

from hpcft.errors import ConfigError, StoreError

ENV_ROOT = "HPCFT_STORE_ROOT"
DEFAULT_ROOT = "/dev/shm"
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


def resolve_root(root: str | os.PathLike | None = None) -> Path:
    """The base directory of the store: `root`, else $HPCFT_STORE_ROOT, else /dev/shm."""
    base = Path(root or os.environ.get(ENV_ROOT) or DEFAULT_ROOT)
    if not base.is_dir():
        raise ConfigError(f"store root {base} is not a directory; create it or set {ENV_ROOT} to one that exists")
    return base


def job_dir(base: Path, job_id: str, user: str | None = None) -> Path:
    """`<base>/hpcft-<user>-<job>`: one directory per user and job."""
    if not job_id:
        raise ConfigError("the snapshot store needs a job id (pass job_id= or run under Slurm / hpcft run)")
    user = user or getpass.getuser()
    return base / f"hpcft-{_SAFE.sub('_', user)}-{_SAFE.sub('_', str(job_id))}"


def secure_dir(path: Path, *, create: bool = True) -> Path:
    """Create `path` 0700 if missing; refuse it if it is a symlink, not ours, or open to group/others."""
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise StoreError(f"cannot create snapshot directory {path}: {exc.strerror}") from exc
    try:
        st = os.lstat(path)
    except FileNotFoundError as exc:
        raise StoreError(f"snapshot directory {path} does not exist") from exc
    if stat.S_ISLNK(st.st_mode):
        raise StoreError(f"refusing snapshot directory {path}: it is a symlink; remove it and rerun")
    if not stat.S_ISDIR(st.st_mode):
        raise StoreError(f"refusing snapshot directory {path}: it is not a directory; remove it and rerun")
    if st.st_uid != os.geteuid():
        raise StoreError(
            f"refusing snapshot directory {path}: owned by uid {st.st_uid}, not by you (uid {os.geteuid()}); "
            "another user's job may be using it, choose another root (HPCFT_STORE_ROOT)")
    if st.st_mode & 0o077:
        raise StoreError(
            f"refusing snapshot directory {path}: mode {stat.S_IMODE(st.st_mode):04o} lets other users in; "
            f"it must be 0700 (chmod 700 {path}, or remove it)")
    return path


def check_file(fd: int, path: Path) -> None:
    """Refuse an open store file that is not a regular file of ours with mode 0600."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise StoreError(
            f"refusing store file {path}: it must be a regular file owned by you with mode 0600 "
            f"(found uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}); remove it and rerun")
