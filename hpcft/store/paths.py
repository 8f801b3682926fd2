"""Where a job's snapshots live, and the checks that keep other users out of them."""
import errno
import getpass
import logging
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path

from hpcft import events
from hpcft.errors import ConfigError, StoreError

ENV_ROOT = "HPCFT_STORE_ROOT"
DEFAULT_ROOT = "/dev/shm"
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")
_roots_checked: set[Path] = set()  # store roots `_check_root` looked at in this process


def resolve_root(root: str | os.PathLike | None = None) -> Path:
    """The base directory of the store: `root`, else $HPCFT_STORE_ROOT, else /dev/shm."""
    base = Path(root or os.environ.get(ENV_ROOT) or DEFAULT_ROOT)
    if not base.is_dir():
        raise ConfigError(f"store root {base} is not a directory; create it or set {ENV_ROOT} to one that exists")
    _check_root(base)
    return base


def _check_root(base: Path) -> None:
    """Event `store_root_unsafe` (once per root and process) when any user may write to `base` and its sticky bit is
    off: another user could then delete or rename a job's store directory in it."""
    if base in _roots_checked:
        return
    _roots_checked.add(base)
    try:
        mode = os.stat(base).st_mode
    except OSError:
        return  # gone again: the store's own checks say so
    if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        events.emit("store_root_unsafe", level=logging.WARNING, path=str(base), mode=f"{stat.S_IMODE(mode):04o}",
                    reason="any user may write to this directory and its sticky bit is off: another user can delete "
                           "or rename a job's store in it, and the job would then restart from step 0",
                    fix=f"chmod +t {base} (as its owner), or choose another root ({ENV_ROOT})")


def job_dir(base: Path, job_id: str, user: str | None = None) -> Path:
    """`<base>/hpcft-<user>-<job>`: one directory per user and job."""
    if not job_id:
        raise ConfigError("the snapshot store needs a job id (pass job_id= or run under Slurm / hpcft run)")
    user = user or getpass.getuser()
    return base / f"hpcft-{_SAFE.sub('_', user)}-{_SAFE.sub('_', str(job_id))}"



def rank_dir(job: Path, rank: int) -> Path:
    """`<job dir>/rank-<r>`: one rank's slots and manifests."""
    return job / f"rank-{rank:05d}"

def replace_file(path: Path, data: bytes, tmp: Path, sync: bool = False) -> None:
    """Write `data` to `tmp` (0600, never through a symlink, never blocking on a FIFO), fsync it when `sync`, then
    rename it over `path`: a reader sees the old file or the new one, never a part. On failure the OSError is raised
    and `tmp` removed once opened (a directory, FIFO or symlink already at `tmp` is not opened, and left for the
    caller to report)."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    try:
        try:
            check_file(fd, tmp)
        except StoreError as exc:
            raise OSError(errno.EPERM, str(exc)) from exc
        try:
            if os.write(fd, data) != len(data):
                raise OSError(errno.ENOSPC, "short write")
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


RUN_MARKER = "slurm-run"  # in a job's store directory: SLURM_RESTART_COUNT of the run that last wrote it


def mark_run(job: Path, environ: "os._Environ[str] | dict[str, str] | None" = None) -> None:
    """Record which run of the Slurm job writes this store (SLURM_RESTART_COUNT, 0 before any requeue), so that
    slurm/epilog.sh can tell the end of a requeued run (Slurm's count has moved past it: keep the snapshots for
    the next run) from the end of the job (remove them). Slurm shows COMPLETING in both cases."""
    env = os.environ if environ is None else environ
    count = env.get("SLURM_RESTART_COUNT", "0").strip() or "0"
    if not count.isdigit():
        raise ConfigError(f"SLURM_RESTART_COUNT={count!r} is not a number")
    try:
        replace_file(job / RUN_MARKER, f"{int(count)}\n".encode(), job / f".{RUN_MARKER}.{os.getpid()}")
    except OSError as exc:
        raise StoreError(f"cannot write {job / RUN_MARKER}: {exc.strerror or exc}") from exc


def marked_run(job: Path) -> int | None:
    """The run count `mark_run` recorded in `job`, or None (no marker, or not a number)."""
    try:
        text = (job / RUN_MARKER).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


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
            f"(found {_kind(st.st_mode)}, uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}); remove it and rerun")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a symlink")):
        if test(mode):
            return name
    return "an unknown kind of file"


def open_file(path: Path, flags: int, *, create: bool = False) -> int:
    """Open a store file for `flags` (os.O_RDONLY / O_RDWR) and return its descriptor: never through a symlink, never
    blocking on a FIFO, and only a regular file of ours with mode 0600; anything else, and any OSError, is a
    StoreError naming the path and what sits there (every store file is opened here, so no caller sees an OSError)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_CREAT if create else 0), 0o600)
    except OSError as exc:
        what = exc.strerror or str(exc)
        try:
            what = f"{what}; it is {_kind(os.lstat(path).st_mode)}"
        except OSError:
            pass
        raise StoreError(f"cannot open store file {path}: {what}; remove or fix it and rerun") from exc
    try:
        check_file(fd, path)
        os.set_blocking(fd, True)
    except (StoreError, OSError) as exc:
        os.close(fd)
        if isinstance(exc, StoreError):
            raise
        raise StoreError(f"cannot use store file {path}: {exc.strerror or exc}") from exc
    return fd


def remove_file(path: Path) -> None:
    """Unlink a store file if present; StoreError (not OSError) if it cannot be (e.g. a directory sits there)."""
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        try:
            kind = f"; it is {_kind(os.lstat(path).st_mode)}"
        except OSError:
            kind = ""
        raise StoreError(f"cannot remove store file {path}: {exc.strerror or exc}{kind}; remove it by hand") from exc


def read_file(path: Path, unless: Callable[[os.stat_result], bool] | None = None) -> bytes | None:
    """All bytes of a store file (a manifest, a pin), opened by `open_file`; StoreError if it cannot be read. None,
    without reading, when `unless(the opened file's fstat)` is true (a caller that holds what that file says)."""
    fd = open_file(path, os.O_RDONLY)
    try:
        if unless is not None and unless(os.fstat(fd)):
            return None
        with os.fdopen(fd, "rb", closefd=False) as fh:
            return fh.read()
    except OSError as exc:
        raise StoreError(f"cannot read {path}: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)
