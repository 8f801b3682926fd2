"""`python -m hpcft.launch.task -- CMD …`: the first thing each trainer task runs. It turns the exported slot
layout plus SLURMD_NODENAME/SLURM_LOCALID into this task's ranks, starts the progress watcher, and hands CMD to the
node's warm standby (hpcft/launch/warm.py) or, where none can run it, execs CMD."""
import os
import sys

from hpcft.errors import HpcftError
from hpcft.launch import progress, warm
from hpcft.launch.srun import task_env
from hpcft.launch.stage_paths import localized


def main(argv: list[str]) -> int:
    """Set the rank variables and run the command after `--`: in the standby, else in place of this process."""
    command = argv[1:] if argv[:1] == ["--"] else argv
    if not command:
        print("usage: python -m hpcft.launch.task -- CMD [ARGS...]", file=sys.stderr)
        return 2
    try:
        os.environ.update(task_env(os.environ))
    except HpcftError as exc:
        print(f"hpcft task: error: {exc}", file=sys.stderr)
        return 2
    command = localized(command, os.environ, sys.executable)  # --stage-env: `python` is this node's copy
    job_dir = os.environ.get("HPCFT_JOB_DIR")
    if job_dir:
        rank = int(os.environ["HPCFT_RANK"])
        target = progress.progress_file(job_dir, rank)
        os.environ["HPCFT_PROGRESS_FILE"] = str(target)
        progress.start_watcher(os.environ.get("HPCFT_JOB_ID", "local"), rank, target)
    sys.stdout.flush()
    sys.stderr.flush()
    return warm.run_or_exec(command, os.environ)  # in this node's warm standby, when one can run it


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
