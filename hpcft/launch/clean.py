"""Removing a job's snapshot store from this node's memory, unless a requeue is pending (the work of
slurm/epilog.sh, for `hpcft clean` by hand)."""
import getpass
import logging
import shutil
from pathlib import Path

from hpcft.slurm.state import fields
from hpcft.slurm.runner import Runner
from hpcft.store.paths import job_dir, resolve_root

_log = logging.getLogger(__name__)
KEEP_STATES = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "RESIZING", "SUSPENDED")


def job_state(runner: Runner, job_id: str) -> str | None:
    """Slurm's JobState of the job, or None once Slurm has forgotten it."""
    proc = runner.run(["scontrol", "show", "job", "-o", job_id], check=False)
    if proc.returncode != 0:
        return None
    return fields(proc.stdout.strip()).get("JobState")


def clean(job_id: str, *, runner: Runner, user: str | None = None, root: str | None = None,
          force: bool = False) -> tuple[Path, bool, str]:
    """Remove `<root>/hpcft-<user>-<job>` unless the job may still resume from it; returns (path, removed, why)."""
    path = job_dir(resolve_root(root), job_id, user or getpass.getuser())
    if not path.exists():
        return path, False, "nothing to remove"
    state = None if force else job_state(runner, job_id)
    if state in KEEP_STATES:
        return path, False, f"job {job_id} is {state}: a requeue is pending, the store is kept (use --force)"
    shutil.rmtree(path)
    checked = "not checked (--force)" if force else (state or "unknown to Slurm")
    return path, True, f"removed (job state {checked})"
