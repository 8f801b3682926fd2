"""The run's progress history in the bounded log (issue #31 part 5): a point per change of the step every rank has
completed, at most one per poll, thinned when full with every roll-back kept, read back by `progress.history`."""
import json

from hpcft.launch.fabric import history
from hpcft.launch.fabric.liveview import LiveView
from hpcft.launch.fabric.service import Fabric
from hpcft.launch.node import progress


def _report(view: LiveView, steps: dict[int, int], now: float) -> None:
    view.apply({"tag": "0", "slot": 0, "progress": {str(r): [s, None] for r, s in steps.items()}}, now)


def test_a_point_is_added_when_every_ranks_step_moves_and_only_then():
    view = LiveView()
    _report(view, {0: 3}, 10.0)
    assert not view.mark(2, 10.5)  # rank 1 has said nothing: no step every rank has completed
    _report(view, {1: 4}, 11.0)
    assert view.mark(2, 11.5) and not view.mark(2, 12.0)  # 3 every rank; the same 3 at the next poll: no point
    _report(view, {0: 5}, 12.5)
    assert view.mark(2, 13.0)
    _report(view, {0: 1, 1: 1}, 20.0)  # a roll-back: the ranks resumed from an older step
    version = view.version
    assert view.mark(2, 20.5) and view.version > version  # the log is written again
    assert view.dump(21.0)["history"] == [[11.5, 3], [13.0, 4], [20.5, 1]]


def test_ranks_a_shrunk_world_no_longer_has_leave_the_view_and_do_not_hold_the_history_back():
    view = LiveView()
    _report(view, {0: 9, 1: 9, 2: 9, 3: 9}, 1.0)
    view.mark(4, 1.0)
    _report(view, {0: 10, 1: 10}, 2.0)
    assert view.mark(2, 2.0) and sorted(view.samples()) == [0, 1]
    _report(view, {0: 11, 1: 11, 2: 11}, 3.0)  # grown back: rank 3 has not reported yet
    assert not view.mark(4, 3.0)
    assert view.dump(4.0)["history"] == [[1.0, 9], [2.0, 10]]


def test_a_full_history_keeps_every_other_point_and_every_roll_back():
    points: list[tuple[float, int]] = []
    for i in range(12):
        history.add(points, float(i), 100 if i == 7 else i, limit=12)  # 6 → 100 → 8: a drop from 100 to 8
    assert len(points) == 12
    history.add(points, 12.0, 12, limit=12)
    assert points == [(0.0, 0), (2.0, 2), (4.0, 4), (6.0, 6), (7.0, 100), (8.0, 8), (10.0, 10), (12.0, 12)]
    for i in range(13, 1000):
        history.add(points, float(i), i, limit=12)
        assert len(points) <= 12
    assert points[0] == (0.0, 0) and points[-1] == (999.0, 999)  # the whole run, at a coarser resolution


def test_a_history_of_nothing_but_roll_backs_is_still_bounded():
    points: list[tuple[float, int]] = []
    for i in range(100):
        history.add(points, float(i), i % 2, limit=10)
        assert len(points) <= 10
    assert points[-1] == (99.0, 1)


def test_the_history_reaches_the_log_continues_in_a_requeued_run_and_reads_back(tmp_path):
    fabric = Fabric(tmp_path, emit=lambda *a, **k: None, clock=lambda: 5.0)
    _report(fabric.view, {0: 7}, 5.0)
    fabric.poll(1)
    fabric.close()  # the run's end: the log written; its last poll again (no change: no point)
    assert progress.history(tmp_path) == [(5.0, 7)]
    again = Fabric(tmp_path, emit=lambda *a, **k: None, clock=lambda: 90.0)  # the requeued run loads the log
    _report(again.view, {0: 8}, 90.0)
    again.poll(1)
    again.write()
    assert progress.history(tmp_path) == [(5.0, 7), (90.0, 8)]
    assert json.loads((tmp_path / "status.json").read_text())["history"] == [[5.0, 7], [90.0, 8]]
    assert progress.history(tmp_path.parent / "nothing-here") == []
