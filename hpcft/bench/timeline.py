"""The bench job's timeline (`$OUT/timeline.jsonl`, written by hpcft/bench/train_job.py's ranks on one clock):
reading it, waiting on it, and cutting a recovery into consecutive phases. Shared by `hpcft bench recovery`'s
scenarios and its baselines."""
from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpcft import events
from hpcft.errors import HpcftError

JOB = Path(__file__).with_name("train_job.py")
ACTIVE, VICTIM_RANK = 4, 2  # the job's ranks (one per active node) and the one a fault kills


def job_env(opts: Any, out: Path, **extra: str) -> dict[str, str]:
    """The bench job's environment (train_job.py) for `opts` (steps, step_delay, width, layers), writing to `out`."""
    return {"OUT": str(out), "STEPS": str(opts.steps), "STEP_DELAY": str(opts.step_delay), "WIDTH": str(opts.width),
            "LAYERS": str(opts.layers), "PYTHONUNBUFFERED": "1", **extra}


class Tail:
    """The job's timeline in `out` as it grows: `records()` parses only the lines written since the last call (a poll
    of a long run's timeline re-read whole would cost the job it measures a share of its cores)."""

    def __init__(self, out: Path) -> None:
        self.tail, self.kept = events.Tail(out / "timeline.jsonl"), []

    def records(self) -> list[dict]:
        """Every record so far, in the order written (a line still being written waits for the next call)."""
        self.kept += self.tail.new()
        return self.kept


def read(out: Path) -> list[dict]:
    """Every record of the job's timeline in `out`, in the order written."""
    return Tail(out).records()


def wait(predicate: Callable[[], Any], what: str, timeout: float, proc: subprocess.Popen | None = None) -> Any:
    """`predicate()` once true, polled; HpcftError naming `what` on timeout or when `proc` ends first."""
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            raise HpcftError(f"the job ended (exit status {proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise HpcftError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


def wait_victim(out: Path, opts: Any, proc: subprocess.Popen | None = None) -> int:
    """The pid of rank VICTIM_RANK of the first launch (run "0.0"), waited for until every rank has completed step
    `opts.fault_at` (up to `opts.timeout`)."""
    def victim() -> int | None:
        recs = [r for r in read(out) if r["run"] == "0.0"]
        if len({r["rank"] for r in recs if r["what"] == "step" and r["step"] >= opts.fault_at}) < ACTIVE:
            return None
        return next((r["pid"] for r in recs if r["what"] == "start" and r["rank"] == VICTIM_RANK), None)

    return wait(victim, f"step {opts.fault_at} on every rank", opts.timeout, proc)


def phases(timeline: list[dict], run: str, fault: float, decided: float) -> dict[str, float]:
    """Consecutive phases of one recovery (seconds), from the fault to the first step every rank of `run`
    completed; plus the parts of the relaunch (srun start, imports, process group) and the step resumed from."""
    recs = [r for r in timeline if r["run"] == run]

    def per_rank(what: str) -> dict[int, dict]:
        first = {r["rank"]: r for r in reversed(recs) if r["what"] == what}  # reversed: each rank's first stays
        if len(first) < ACTIVE:
            raise HpcftError(f"run {run} recorded {what!r} for ranks {sorted(first)} only")
        return first

    start, imported, init, built, restored, first_step = (
        per_rank(w) for w in ("start", "imported", "init", "built", "restored", "step"))
    t_built = max(r["t"] for r in built.values())
    t_restored = max(r["t"] for r in restored.values())
    t_step = max(r["t"] for r in first_step.values())
    return {
        "total_s": t_step - fault,
        "detection_s": decided - fault,
        "relaunch_s": t_built - decided,
        "restore_s": t_restored - t_built,
        "first_step_s": t_step - t_restored,
        "relaunch_srun_s": min(r["t"] for r in start.values()) - decided,
        "relaunch_import_s": max(imported[k]["t"] - start[k]["t"] for k in start),
        "relaunch_init_s": max(init[k]["t"] - imported[k]["t"] for k in start),
        "relaunch_build_s": max(built[k]["t"] - init[k]["t"] for k in start),
        "restore_rank_max_s": max(restored[k]["t"] - built[k]["t"] for k in start),
        "resumed_from": min(r["step"] for r in restored.values()),
    }
