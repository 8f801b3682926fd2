"""Stopping steps (hpcft/launch/steps.py): a step whose srun does not end on SIGTERM is killed after --kill-grace;
one with a lost node (whose tasks never answer, so srun would wait the whole grace) after LOST_NODE_GRACE_S."""
import subprocess
import sys
import time

from hpcft.launch.steps import LOST_NODE_GRACE_S, StepStopper

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
    assert said == [said[0]] and said[0]["grace"] == LOST_NODE_GRACE_S and said[0]["steps"] == "train", said

    said.clear()
    stopper = StepStopper(_Runner(), "1", kill_grace=1.5, emit=lambda *a, **k: said.append(k))
    p = _stubborn()
    started = time.monotonic()
    stopper.stop({"train": p})
    assert p.poll() is not None and time.monotonic() - started >= 1.5 and said[0]["grace"] == 1.5, said
