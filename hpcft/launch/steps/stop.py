"""Stopping the srun steps `hpcft run` started (the trainers', the agents', the janitors'): SIGTERM to each srun,
`--kill-grace`, then SIGKILL for the sruns left and `scancel --signal=KILL` for their steps' tasks; `tee` passes a
step's stderr through."""
from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping

from hpcft.slurm.runner import Runner

# a step with a lost node: its srun waits for that node's tasks, which never answer, and on a confined node it says
# nothing of the others' end for seconds, though they were killed at once; the relaunch does not wait for it: each
# relaunched process waits on its node for its predecessor's exit (the store's and the agent's lock, store/writer.py)
LOST_NODE_GRACE_S = 0.2
SETTLE_POLL_S = 0.02  # how often a stop looks whether its steps have ended


class StepStopper:
    """Stops steps of job `job_id`; `emit` records a `step_killed` event when a step had to be killed."""

    def __init__(self, runner: Runner, job_id: str, kill_grace: float, emit: Callable[..., None]):
        self.runner, self.job_id, self.kill_grace, self.emit = runner, job_id, kill_grace, emit
        self._background: list[subprocess.Popen] = []  # step kills still retrying

    def stop(self, steps: Mapping[str, subprocess.Popen | None], *, lost: bool = False,
             settled: Callable[[], bool] | None = None) -> None:
        """Stop the running ones of {step name: srun} together: SIGTERM each srun, past the grace SIGKILL them and their
        tasks; `lost`: srun would wait on the lost node's tasks, so the grace is LOST_NODE_GRACE_S or until `settled()`.
        `scancel --signal=KILL` is not waited for: Slurm retries it every 5+ s on a step "in a transitional state"."""
        running = {name: p for name, p in steps.items() if p is not None and p.poll() is None}
        if not running:
            return
        started, grace = time.monotonic(), min(self.kill_grace, LOST_NODE_GRACE_S) if lost else self.kill_grace
        for p in running.values():
            p.send_signal(signal.SIGTERM)
        left = dict(running)
        while True:
            left = {name: p for name, p in left.items() if p.poll() is None}
            if not left or time.monotonic() >= started + grace or (lost and settled is not None and settled()):
                break
            time.sleep(SETTLE_POLL_S)
        if not left:
            return
        for p in left.values():
            p.kill()
        for step_id, name in steps_of(self.runner, self.job_id):
            if name in left:
                self._background.append(self.runner.popen(["scancel", "--signal=KILL", step_id],
                                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for p in left.values():
            p.wait()
        self._background = [p for p in self._background if p.poll() is None]
        self.emit("step_killed", level=logging.WARNING, steps=",".join(left), grace=grace,
                  seconds=round(time.monotonic() - started, 3))


def steps_of(runner: Runner, job_id: str) -> list[tuple[str, str]]:
    """(step id, name) of the job's running steps, as squeue lists them (the batch and extern steps included)."""
    listed = runner.run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i %j"], check=False).stdout
    return [(step_id, name) for step_id, _, name in (line.strip().partition(" ") for line in listed.splitlines())
            if step_id]


def stop_steps_left(runner: Runner, job_id: str, keep: tuple[str, ...]) -> tuple[list[str], list[tuple[str, str]]]:
    """Kill the steps a lost supervisor left, but those named in `keep` and Slurm's own (batch, extern), with one
    scancel from a thread, not waited for: slurmctld answers it only once it gave up on the lost node (MessageTimeout;
    6 s of a 17 s takeover in the sandbox), though the tasks on the live nodes are gone at once, as after any node
    loss (StepStopper); (the names of those killed, (id, name) of those kept)."""
    steps = [(i, n) for i, n in steps_of(runner, job_id)
             if not i.endswith((".batch", ".extern")) and n not in ("batch", "extern")]
    killed = [(i, n) for i, n in steps if n not in keep]
    if killed:
        threading.Thread(target=runner.run, args=(["scancel", "--signal=KILL", *(i for i, _ in killed)],),
                         kwargs={"check": False}, daemon=True, name="hpcft-kill-left").start()
    return [n for _, n in killed], [(i, n) for i, n in steps if n in keep]


def tee(stream, lines: list[str]) -> None:
    """Pass srun's stderr through to ours and keep its lines for the per-task error summary."""
    for line in stream:
        sys.stderr.write(line)
        lines.append(line.rstrip("\n"))
