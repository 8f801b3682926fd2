"""Lost progress as the supervisor sees it (hpcft/launch/losses.py): its live view of progress before a launch against the
restore events its ranks record, read from a real job directory."""
import time

from hpcft import events
from hpcft.launch import losses
from hpcft.launch.fabric.liveview import LiveView


def _progress(steps: dict[int, int]) -> LiveView:
    view = LiveView()
    view.apply({"progress": {str(r): [s, None] for r, s in steps.items()}}, time.time())
    return view


def test_a_restart_from_step_0_after_progress_is_a_loss_of_every_step(tmp_path):
    view = _progress({0: 9, 1: 8, 2: 9})
    assert view.reached(3) == 8 and view.reached(4) is None
    events.emit("restore_none", log_dir=tmp_path, rank=2)  # recorded before the launch: ignored
    watch = losses.RestoreWatch(tmp_path, 3, since=time.time(), before=8, reason="node n3 lost")
    assert watch.poll() is None
    events.emit("restore_none", log_dir=tmp_path, rank=1, reason="no version is complete on every rank")
    loss = watch.poll()
    assert (loss.reached, loss.resumed_from, loss.steps_lost) == (8, 0, 8) and "node n3 lost" in loss.line()
    assert watch.poll() is None  # said once


def test_resuming_from_the_newest_step_loses_nothing_and_an_older_one_the_steps_between(tmp_path):
    watch = losses.RestoreWatch(tmp_path, 2, since=time.time(), before=8, reason="relaunch")
    events.emit("restore_done", log_dir=tmp_path, rank=0, step=8)
    assert watch.poll() is None and not watch.done  # rank 1 has not restored yet
    events.emit("restore_done", log_dir=tmp_path, rank=1, step=8)
    assert watch.poll() is None and watch.done
    older = losses.RestoreWatch(tmp_path, 2, since=time.time(), before=8, reason="relaunch")
    for rank in (0, 1):
        events.emit("restore_done", log_dir=tmp_path, rank=rank, step=6)
    assert older.poll().steps_lost == 2
    first = losses.RestoreWatch(tmp_path, 2, since=time.time(), before=None, reason="first launch")
    assert first.reached_after(None) is None  # its ranks have not restored: nothing reached
    events.emit("restore_none", log_dir=tmp_path, rank=0)
    assert first.poll() is None and first.reached_after(5) == 5  # nothing to lose; then what its trainers reached


def test_a_step_protected_everywhere_counts_as_reached_though_progress_said_less(tmp_path):
    """The demo's flake: the agents protected step 1 on every node while the view's progress (up to a second late)
    still said 0; the relaunch resumed from 0. That is a loss of a step, not none."""
    first = losses.RestoreWatch(tmp_path, 2, since=time.time() - 10, before=None, reason="first launch")
    events.emit("snapshot_protected", log_dir=tmp_path, tag="0", step=3, slots=2)  # a kept agent's, before restore
    for rank in (0, 1):
        events.emit("restore_done", log_dir=tmp_path, rank=rank, step=0)
    late = {"event": "snapshot_protected", "time": time.time() - 0.5, "level": "INFO", "tag": "0", "step": 4}
    events.write(late, tmp_path)  # a kept agent's pass that ended before the restore, its record written after it
    events.emit("snapshot_protected", log_dir=tmp_path, tag="0", step=1, slots=2)
    assert first.reached_after(0) == 1 and first.reached_after(4) == 4
    relaunch = losses.RestoreWatch(tmp_path, 2, since=time.time(), before=first.reached_after(0), reason="node lost")
    events.emit("restore_none", log_dir=tmp_path, rank=0)
    assert relaunch.poll().steps_lost == 1
