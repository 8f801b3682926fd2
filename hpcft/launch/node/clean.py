"""Remove a job's snapshot store from this node's memory unless a requeue is pending (slurm/epilog.sh's work, for
`hpcft clean` by hand): Slurm says the job waits to run again, or its restart count moved past the run that wrote the
store (store.paths.mark_run), since a requeued run ends COMPLETING as the job's end does."""
import getpass
import logging
import shutil
from pathlib import Path

from hpcft.slurm.state import fields
from hpcft.slurm.runner import Runner
from hpcft.store.paths import job_dir, marked_run, resolve_root

_log = logging.getLogger(__name__)
KEEP_STATES = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "RESIZING", "SUSPENDED")
# the job is over: no run of it will read the store again, whichever run wrote it
ENDED_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
                "PREEMPTED")


def job_state(runner: Runner, job_id: str) -> tuple[str | None, int]:
    """Slurm's JobState and restart count of the job; (None, 0) once Slurm has forgotten it."""
    proc = runner.run(["scontrol", "show", "job", "-o", job_id], check=False)
    if proc.returncode != 0:
        return None, 0
    f = fields(proc.stdout.strip())
    restarts = f.get("Restarts", "0")
    return f.get("JobState"), int(restarts) if restarts.isdigit() else 0


def clean(job_id: str, *, runner: Runner, user: str | None = None, root: str | None = None,
          force: bool = False, keep_unknown: bool = False) -> tuple[Path, bool, str]:
    """Remove `<root>/hpcft-<user>-<job>` unless the job may still resume from it; returns (path, removed, why).
    `keep_unknown`: keep it too when Slurm does not answer (while the job may still run: never drop it on a
    guess); by default a job Slurm does not know is over (purged after MinJobAge)."""
    path = job_dir(resolve_root(root), job_id, user or getpass.getuser())
    if not path.exists():
        return path, False, "nothing to remove"
    state, restarts = (None, 0) if force else job_state(runner, job_id)
    if state is None and keep_unknown and not force:
        return path, False, f"Slurm did not answer about job {job_id}: the store is kept"
    if state in KEEP_STATES:
        return path, False, f"job {job_id} is {state}: a requeue is pending, the store is kept (use --force)"
    written = marked_run(path)
    if state not in ENDED_STATES and state is not None and written is not None and restarts > written:
        return path, False, (f"job {job_id} was requeued after run {written} wrote the store (restart count "
                             f"{restarts}): its next run resumes from it, the store is kept (use --force)")
    shutil.rmtree(path)
    checked = "not checked (--force)" if force else (state or "unknown to Slurm")
    return path, True, f"removed (job state {checked})"
