"""Training progress as the supervisor sees it: one small file per rank, `<job dir>/progress/rank-<r>`, holding
the newest completed step and, after it, the rank's `ready_s` (hpcft/snapshot/timing.py) from that snapshot, for
the straggler detector. A watcher next to each task writes it from what the Checkpointer already commits (its
manifests in the node-local store), so training code needs no hook and no extra file is written; any task may also
write it itself (the path is in $HPCFT_PROGRESS_FILE; a bare step number is read as a step without a measure)."""
import ctypes
import json
import logging
import os
import signal
import time
from pathlib import Path

from hpcft.errors import HpcftError
from hpcft.store.paths import job_dir as store_job_dir, rank_dir, replace_file, resolve_root

_log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


def progress_file(job_dir: str | os.PathLike, rank: int) -> Path:
    return Path(job_dir) / "progress" / f"rank-{rank:05d}"


def newest(directory: Path) -> tuple[int, float | None] | None:
    """(step, ready_s or None) of the highest step among committed manifests (`slot-*.json`) in a rank's store
    directory, if any."""
    best = None
    for path in directory.glob("slot-*.json"):
        try:
            manifest = json.loads(path.read_text(encoding="utf-8"))
            step = int(manifest["step"])
            ready = (manifest.get("timing") or {}).get("ready_s")
            found = (step, None if ready is None else float(ready))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # being replaced right now, or not a manifest: the next poll sees the new one
        best = found if best is None or step > best[0] else best
    return best


def write(path: Path, step: int, ready_s: float | None = None) -> None:
    """Publish `step` (and the rank's `ready_s`) atomically (write, then rename), so a reader never sees half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = str(step) if ready_s is None else f"{step} {ready_s:.6f}"
    replace_file(path, text.encode(), path.with_name(f".{path.name}.{os.getpid()}"))


def _parse(text: str) -> tuple[int, float | None]:
    words = text.split()
    return int(words[0]), float(words[1]) if len(words) > 1 else None


def samples(job_dir: str | os.PathLike) -> dict[int, tuple[int, float | None, float]]:
    """{rank: (step, ready_s or None, mtime)} of every progress file in the job directory."""
    found = {}
    for path in (Path(job_dir) / "progress").glob("rank-*"):
        try:
            step, ready = _parse(path.read_text(encoding="utf-8"))
            found[int(path.name.removeprefix("rank-"))] = (step, ready, path.stat().st_mtime)
        except (OSError, ValueError, IndexError):
            continue
    return found


def read(job_dir: str | os.PathLike) -> dict[int, tuple[int, float]]:
    """{rank: (step, mtime)} of every progress file in the job directory."""
    return {rank: (step, mtime) for rank, (step, _, mtime) in samples(job_dir).items()}


def last_change(job_dir: str | os.PathLike, since: float) -> float:
    """The time of the newest progress report after `since` (wall clock), or `since` if there is none."""
    times = [mtime for _, mtime in read(job_dir).values() if mtime > since]
    return max(times, default=since)


def watch(job_id: str, rank: int, target: Path, interval: float = 1.0) -> None:
    """Copy the rank's newest committed step into `target` until the parent (the training task) dies. A step the file
    already holds (a relaunch finds its rank's last one in the store) is not written again: its new mtime would tell
    the hang watchdog that the launch completed a step while it is still starting up."""
    parent = os.getppid()
    source = None
    try:
        last: int | None = _parse(target.read_text(encoding="utf-8"))[0]
    except (OSError, ValueError, IndexError):
        last = None
    while os.getppid() == parent:
        if source is None:
            try:
                source = rank_dir(store_job_dir(resolve_root(), job_id), rank)
            except HpcftError:  # no store root yet: keep polling, progress is best effort
                source = None
        if source is not None:
            got = newest(source)
            if got is not None and got[0] != last:
                try:
                    write(target, *got)
                    last = got[0]
                except OSError as exc:
                    _log.warning("cannot write progress file %s: %s", target, exc)
        time.sleep(interval)


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (PR_SET_PDEATHSIG); best effort where prctl is missing."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def start_watcher(job_id: str, rank: int, target: Path, interval: float = 1.0) -> int:
    """Fork a watcher that dies with its parent (PR_SET_PDEATHSIG); returns its pid, 0 in the child never."""
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        die_with_parent()  # else the getppid() check still ends the loop within one interval
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        watch(job_id, rank, target, interval)
    except BaseException:  # noqa: BLE001 - the child must never return into the parent's code
        code = 1
    finally:
        os._exit(code)
