"""The baselines of `hpcft bench recovery` (docs/results.md): what a user does without hpcft on the same job
(train_job.py with CKPT=disk), one rank SIGKILLed after step `fault_at`: the batch script runs `srun` again in the
allocation (relaunch, issue 14's fair one) or `scontrol requeue`s the job (requeue), and the next launch
`torch.load`s; detection ends when the script reacts."""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from hpcft.bench import timeline
from hpcft.errors import HpcftError
from hpcft.slurm import state as slurmstate

NAMES = ("relaunch", "requeue")

def _reacted(what: str, tag: str, out: Path) -> str:
    """The shell line a script runs when it reacts: a timeline record under the run tag of the next launch."""
    record = '{"what": "%s", "t": %s, "run": "%s", "rank": -1, "pid": 0}\\n'
    return f"printf '{record}' {what} \"$(date +%s.%N)\" \"{tag}\" >> {out}/timeline.jsonl"


def script(name: str, out: Path) -> str:
    """The batch script of baseline `name`: the job under srun, and the user's reaction to its failure."""
    srun = f"srun --kill-on-bad-exit=1 {sys.executable} {timeline.JOB}"
    head = f"#!/bin/bash\n#SBATCH -N{timeline.ACTIVE} -t 15 --open-mode=append -o {out}/slurm-%j.out\n"
    if name == "relaunch":
        return head + (f"for launch in 0 1 2; do\n"
                       f"  export HPCFT_RESTART_COUNT=$launch  # train_job.py's run tag: 0.<launch>\n"
                       f"  {srun} && exit 0\n"
                       f"  {_reacted('relaunch', '0.$((launch + 1))', out)}\n"
                       f"done\nexit 1\n")
    return head.replace(" -t 15", " --requeue -t 15") + (
        f"{srun}\nrc=$?\nif [ $rc -ne 0 ]; then\n"
        f"  {_reacted('requeue', '$((${SLURM_RESTART_COUNT:-0} + 1)).0', out)}\n"
        f"  scontrol requeue \"$SLURM_JOB_ID\"\nfi\nexit $rc\n")


def run(name: str, sb: Any, opts: Any, out: Path) -> dict[str, float]:
    """Baseline `name` (one of NAMES) in the sandbox `sb`, its output in `out`: the recovery's phases."""
    resumed = {"relaunch": "0.1", "requeue": "1.0"}[name]  # the run tag of the launch after the fault
    out.mkdir(parents=True, exist_ok=True)
    runner = sb.runner()
    job = runner.run(["sbatch", "--parsable"], input=script(name, out),
                     env=timeline.job_env(opts, out, CKPT="disk")).stdout.strip().split(";")[0]
    try:
        pid = timeline.wait_victim(out, opts)
        fault = time.time()
        os.kill(pid, signal.SIGKILL)
        timeline.wait(lambda: slurmstate.job_ended(runner, job), f"the {name} baseline job to end", opts.timeout)
    finally:
        runner.run(["scancel", job], check=False)
    records = timeline.read(out)
    reacted = [r["t"] for r in records if r["what"] == name and r["t"] >= fault]
    if not reacted:
        raise HpcftError(f"the {name} baseline's batch script never reacted to the killed rank; see {out}")
    return timeline.phases(records, resumed, fault, min(reacted))

