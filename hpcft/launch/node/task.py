"""`python -m hpcft.launch.node.task -- CMD …`, the first thing each trainer task runs: this task's ranks from the
exported slot layout and SLURMD_NODENAME/SLURM_LOCALID, $HPCFT_PROGRESS_FILE in the node-local store, the node's
progress reporter in a run without agents, then (on a node the agents rebuild: once they are ready, node/gate.py) CMD
in the node's warm standby, or exec'd where none can run it."""
import os
import sys

from hpcft.errors import HpcftError
from hpcft.store.paths import job_dir as store_job_dir, progress_file, resolve_root, secure_dir
from hpcft.env import AGENTS_REPORT, REPORTS
from hpcft.launch.node import gate, warm
from hpcft.launch.node.srun import task_env
from hpcft.launch.node.broadcast_paths import localized


def main(argv: list[str]) -> int:
    """Set the rank variables and run the command after `--`: in the standby, else in place of this process."""
    command = argv[1:] if argv[:1] == ["--"] else argv
    if not command:
        print("usage: python -m hpcft.launch.node.task -- CMD [ARGS...]", file=sys.stderr)
        return 2
    try:
        os.environ.update(task_env(os.environ))
    except HpcftError as exc:
        print(f"hpcft task: error: {exc}", file=sys.stderr)
        return 2
    command = localized(command, os.environ, sys.executable)  # --broadcast-env: `python` is this node's copy
    job_dir = os.environ.get("HPCFT_JOB_DIR")
    if job_dir:
        try:
            _progress(job_dir)
        except HpcftError as exc:  # no node-local store root: progress is best effort, the training is not
            print(f"hpcft task: no progress reports from this task: {exc}", file=sys.stderr)
    closed = gate.wait(os.environ)  # a node being rebuilt: its ranks restore once the agents are ready
    if closed:
        print(f"hpcft task: error: {closed}", file=sys.stderr)
        return 1
    sys.stdout.flush()
    sys.stderr.flush()
    return warm.run_or_exec(command, os.environ)


def _progress(job_dir: str) -> None:
    """$HPCFT_PROGRESS_FILE in the node's store; the node's reporter when no agent reports its progress."""
    store = secure_dir(store_job_dir(resolve_root(), os.environ.get("HPCFT_JOB_ID", "local")))
    target = progress_file(store, int(os.environ["HPCFT_RANK"]))
    secure_dir(target.parent)
    os.environ["HPCFT_PROGRESS_FILE"] = str(target)
    if os.environ.get(REPORTS) and os.environ.get(AGENTS_REPORT) == "0" and os.environ.get("HPCFT_LOCAL_RANK") == "0":
        from hpcft.launch.node import progress  # the transport's imports, only where the reporter runs

        progress.start_reporter(job_dir, int(os.environ["HPCFT_NODE_RANK"]), store, dict(os.environ))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
