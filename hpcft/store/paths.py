"""Where a job's snapshots live, every name of that layout (`<root>/hpcft-<user>-<job>/rank-<r>/slot-<k>.data`, ...),
and the checks that keep other users out."""
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
_RANK = re.compile(r"rank-(\d{5,})$")
_SLOT = re.compile(r"slot-(\d{1,6})\.(data|json|pin)$")
DATA, MANIFEST, PIN = "data", "json", "pin"  # a slot's bytes, its manifest (which makes them a version), a reader's pin
RUN_MARKER = "slurm-run"  # in a job's store directory: SLURM_RESTART_COUNT of the run that last wrote it
PINS = "agent-pins"  # in a job's store directory: a reader here pins (the agent: up to two versions per rank)
LOCK = "writer.lock"  # in a rank directory: held by the process writing it (hpcft.store.writer)
DIRTY = ".dirty"  # the suffix of a file being written, renamed over its name once complete (`dirty`)
PROGRESS = "progress"  # in a job's store directory: the steps jobs without a Checkpointer report (progress_file)
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
    off: another user could delete or rename a job's store in it."""
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
    return base / f"hpcft-{safe(user or getpass.getuser())}-{safe(str(job_id))}"


def safe(name: str) -> str:
    """`name` with every character but letters, digits and `_.-` replaced by `_`: fit for a file name."""
    return _SAFE.sub("_", name)


def rank_name(rank: int) -> str:
    """`rank-<r>` (5 digits at least): a rank's directory, its progress file, its sidecar in the durable tier."""
    return f"rank-{rank:05d}"


def slot_ranks(slot: int, tasks_per_node: int) -> range:
    """The global ranks slot `slot` runs (`hpcft run`'s layout: fixed by the slot, not by srun's node order), whose
    directories its node's store holds."""
    return range(slot * tasks_per_node, (slot + 1) * tasks_per_node)


def rank_dir(job: Path, rank: int) -> Path:
    """`<job dir>/rank-<r>`: one rank's slots and manifests."""
    return job / rank_name(rank)


def progress_file(job: Path, rank: int) -> Path:
    """`<job dir>/progress/rank-<r>`: where a job that does not use the Checkpointer may write its step."""
    return job / PROGRESS / rank_name(rank)


def _matches(directory: Path, name: re.Pattern) -> list[re.Match]:
    """The names in `directory` that match `name`; none where there is no such directory, OSError if unreadable."""
    try:
        return [m for m in map(name.match, os.listdir(directory)) if m]
    except (FileNotFoundError, NotADirectoryError):
        return []


def ranks(directory: Path) -> dict[int, Path]:
    """rank → its entry in `directory` (a job dir's rank directories, its progress files), by name, in rank order."""
    return dict(sorted((int(m.group(1)), directory / m.group(0)) for m in _matches(directory, _RANK)))


def slot_file(directory: Path, k: int, kind: str = MANIFEST) -> Path:
    """`<rank dir>/slot-<k>.<kind>`: slot k's MANIFEST, DATA or PIN."""
    return directory / f"slot-{k}.{kind}"


def slot_files(directory: Path, kind: str = MANIFEST) -> dict[int, Path]:
    """slot → its `kind` file, for each one in the rank directory `directory`, by name."""
    return {int(m.group(1)): directory / m.group(0) for m in _matches(directory, _SLOT) if m.group(2) == kind}


def dirty(path: Path, writer: int | None = None) -> Path:
    """`<path>[.<writer>].dirty`: where `path` is written before the rename over it; `writer`: a pid, where several
    processes may write it."""
    return path.with_name(f"{path.name}{'' if writer is None else f'.{writer}'}{DIRTY}")


def replace_file(path: Path, data: bytes, tmp: Path | None = None, sync: bool = False) -> None:
    """Write `data` to `tmp` (default `.<name>.<pid>` beside `path`; 0600, never through a symlink or blocking on a
    FIFO), fsync it when `sync`, then rename it over `path`: a reader sees the old file or the new one. On failure the
    OSError is raised and `tmp` removed once opened (anything but a file already there is left to the caller)."""
    tmp = tmp or path.with_name(f".{path.name}.{os.getpid()}")
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


def mark_run(job: Path, environ: "os._Environ[str] | dict[str, str] | None" = None) -> None:
    """Record which run of the Slurm job writes this store (SLURM_RESTART_COUNT): slurm/epilog.sh keeps the snapshots
    when the count moved past it (a requeue, not the job's end: Slurm shows COMPLETING for both)."""
    env = os.environ if environ is None else environ
    count = env.get("SLURM_RESTART_COUNT", "0").strip() or "0"
    if not count.isdigit():
        raise ConfigError(f"SLURM_RESTART_COUNT={count!r} is not a number")
    try:
        replace_file(job / RUN_MARKER, f"{int(count)}\n".encode())
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
    """A store file's descriptor, opened for `flags` never through a symlink or blocking on a FIFO: only a regular file
    of ours with mode 0600, anything else (or any OSError) a StoreError naming the path and what sits there."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_CREAT if create else 0), 0o600)
    except OSError as exc:
        what = f"{exc.strerror or exc}{_what(path)}"
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
        what = f"{exc.strerror or exc}{_what(path)}"
        raise StoreError(f"cannot remove store file {path}: {what}; remove it by hand") from exc


def _what(path: Path) -> str:
    """`; it is <what sits at path>`, or "" where nothing can be said."""
    try:
        return f"; it is {_kind(os.lstat(path).st_mode)}"
    except OSError:
        return ""


def read_file(path: Path, unless: Callable[[os.stat_result], bool] | None = None) -> bytes | None:
    """All bytes of a store file, opened by `open_file` (StoreError if unreadable); None, unread, when
    `unless(the opened file's fstat)` is true (the caller holds what it says)."""
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
