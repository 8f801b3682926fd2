"""Training progress as the supervisor sees it: each rank's newest committed step and its `ready_s` (or the step in
$HPCFT_PROGRESS_FILE, for a job without the Checkpointer), sent by the node's agent or, without agents, by a reporter
the node's first task forks; `read`, `samples` and `history` read the job's bounded log."""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from pathlib import Path

from hpcft.agent.transport import secret as job_secret, uplink
from hpcft.agent.status import read_log

_PR_SET_PDEATHSIG = 1


def samples(job_dir: str | os.PathLike) -> dict[int, tuple[int, float | None, float]]:
    """{rank: (step, ready_s or None, when the supervisor saw it change)} from the job's bounded log."""
    return {int(r): (int(s), t, float(c)) for r, (s, t, c) in (read_log(job_dir).get("progress") or {}).items()}


def read(job_dir: str | os.PathLike) -> dict[int, tuple[int, float]]:
    """{rank: (step, when it changed)} from the job's bounded log."""
    return {rank: (step, changed) for rank, (step, _, changed) in samples(job_dir).items()}


def history(job_dir: str | os.PathLike) -> list[tuple[float, int]]:
    """The run's progress history from the job's bounded log, oldest first: (t, s) says that at wall time t the
    supervisor first saw every rank's newest step at s (progress when s rose, a roll-back when it fell); thinned to at
    most 2,000 points, so neighbours may be far apart (docs/reference/supervisor.md, "Progress history")."""
    return [(float(t), int(s)) for t, s in read_log(job_dir).get("history") or ()]


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (PR_SET_PDEATHSIG); best effort where prctl is missing."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def start_reporter(job_dir: str, slot: int, store: Path, environ: dict[str, str], interval: float = 1.0) -> int:
    """Fork the node's reporter (a run without agents): it sends the slot's progress until its parent task dies."""
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        die_with_parent()  # else the getppid() check still ends the loop within one interval
        parent = os.getppid()
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        secret = job_secret.load(Path(job_dir) / job_secret.NAME)
        up = uplink.from_env(secret, tag=f"trainers-{environ.get('HPCFT_RESTART_COUNT', '0')}", slot=slot,
                             node=environ.get("HPCFT_NODE_NAME", ""), job=store, environ=environ)
        while up is not None and os.getppid() == parent:
            time.sleep(interval)
    except BaseException:  # noqa: BLE001 - the child must never return into the parent's code
        code = 1
    finally:
        os._exit(code)
