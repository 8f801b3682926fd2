"""Stopping steps (hpcft/launch/steps/stop.py): a step whose srun does not end on SIGTERM is killed after --kill-grace;
one with a lost node (whose tasks never answer, so srun would wait the whole grace) after LOST_NODE_GRACE_S."""
import subprocess
import sys
import time

from hpcft.launch.steps import stop
from hpcft.launch.steps.stop import StepStopper
from hpcft.slurm import state as slurmstate

STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"


class _Runner:
    """No Slurm here: the squeue listing of the steps is empty (the stand-in srun is not a step)."""

    def run(self, argv, check=True):
        return subprocess.CompletedProcess(argv, 0, stdout="", stderr="")

    def popen(self, argv, **kwargs):
        raise AssertionError(f"nothing to scancel: {argv}")


def _stubborn() -> subprocess.Popen:
    """An srun stand-in that ignores SIGTERM, as srun waiting on a frozen node's tasks does."""
    p = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True)
    p.stdout.readline()
    return p


def test_a_step_with_a_lost_node_gets_the_short_grace_and_the_others_the_whole_one():
    said: list = []
    stopper = StepStopper(_Runner(), "1", kill_grace=600.0, emit=lambda *a, **k: said.append(k))
    p = _stubborn()
    started = time.monotonic()
    stopper.stop({"train": p}, lost=True)
    assert p.poll() is not None and time.monotonic() - started < 60, "killed long before the 600 s grace"
    assert said == [said[0]] and said[0]["grace"] == stop.LOST_NODE_GRACE_S and said[0]["steps"] == "train", said

    said.clear()
    stopper = StepStopper(_Runner(), "1", kill_grace=1.5, emit=lambda *a, **k: said.append(k))
    p = _stubborn()
    started = time.monotonic()
    stopper.stop({"train": p})
    assert p.poll() is not None and time.monotonic() - started >= 1.5 and said[0]["grace"] == 1.5, said


def test_a_lost_node_stop_ends_once_srun_reported_every_other_task_ended(monkeypatch):
    """srun waits on the lost node's tasks, which never answer; once it has reported the others ended there is
    nothing left to wait for, so the stop does not sit out the lost-node grace (made long here to tell them apart)."""
    monkeypatch.setattr(stop, "LOST_NODE_GRACE_S", 5.0)
    said: list = []
    stopper = StepStopper(_Runner(), "1", kill_grace=600.0, emit=lambda *a, **k: said.append(k))
    lines = ["srun: error: frontier00042: tasks 0-6: Terminated"]
    settled = lambda: slurmstate.ended_tasks(lines).get("frontier00042", 0) >= 8  # noqa: E731
    p = _stubborn()
    started = time.monotonic()
    lines.append("srun: error: frontier00042: task 7: Killed")
    stopper.stop({"train": p}, lost=True, settled=settled)
    assert p.poll() is not None and time.monotonic() - started < stop.LOST_NODE_GRACE_S / 2, "ended at the settle"
    assert said[0]["steps"] == "train", said


def test_a_settle_never_shortens_a_stop_without_a_lost_node():
    stopper = StepStopper(_Runner(), "1", kill_grace=1.0, emit=lambda *a, **k: None)
    p = _stubborn()
    started = time.monotonic()
    stopper.stop({"train": p}, settled=lambda: True)
    assert time.monotonic() - started >= 1.0


def test_ended_tasks_counts_each_task_once_per_node_from_srun_lines():
    lines = ["srun: error: frontier00042: tasks 0-3,6: Terminated",
             "srun: error: frontier00042: task 3: Killed",  # the same task again, after the SIGKILL
             "srun: error: frontier00043: task 9: Exited with exit code 1",
             "srun: Job step aborted: Waiting up to 32 seconds for job step to finish.",
             "slurmstepd: error: *** STEP 7.0 ON frontier00042 CANCELLED AT 2026-12-02T10:00:00 ***"]
    assert slurmstate.ended_tasks(lines) == {"frontier00042": 5, "frontier00043": 1}
