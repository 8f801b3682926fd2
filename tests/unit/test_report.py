"""`hpcft report` (issue #31 part 5) on a canned job directory: the summary (incidents, recovery times, steps lost,
pace), the timeline PNG with matplotlib, the one-line hint without it, the command's text and JSON."""
import json
import sys

import pytest

from hpcft import events
from hpcft.cli import main
from hpcft.report import summary, timeline


def _job(job_dir):
    """A run of 26 steps at 1 step/s: a node lost at step 10 (resumed from 8), an in-process restart at step 19."""
    records = [("start", 1000.0, {"job": "77", "slots": "n1,n2"}),
               *[("restore_none", 1002.0, {"rank": r}) for r in (0, 1)],
               ("node_bad", 1014.5, {"node": "n2", "state": "DOWN"}),
               ("decision", 1015.0, {"action": "replace", "cause": "node_failed", "bad_nodes": "n2",
                                     "reason": "n2: DOWN"}),
               *[("restore_done", 1020.0, {"rank": r, "step": 8}) for r in (0, 1)],
               ("progress_lost", 1021.0, {"reached": 10, "resumed_from": 8, "steps_lost": 2, "reason": "n2 lost"}),
               *[("inprocess_restart", 1033.0, {"rank": r, "cause": "exception", "step": 19, "total_s": 0.5})
                 for r in (0, 1)],
               ("decision", 1041.0, {"action": "done", "cause": "success", "reason": "finished"}),
               ("summary", 1041.0, {"action": "done", "exit_code": 6, "steps_lost": 2, "lost": "2 step(s) lost"})]
    for kind, t, fields in records:
        events.append(job_dir, {"event": kind, "time": t, "level": "INFO", **fields})
    history = [[1004.0 + s, s] for s in range(1, 11)] + [[1020.5, 8]] + [[1013.0 + s, s] for s in range(9, 20)] \
        + [[1014.0 + s, s] for s in range(20, 27)]
    (job_dir / "status.json").write_text(json.dumps({"time": 1041.0, "progress": {}, "history": history}))
    return job_dir


def test_the_summary_names_each_incident_its_recovery_and_the_steps_it_lost(tmp_path):
    run = summary.read(_job(tmp_path))
    assert (run.job, run.runs, run.wall_s, run.first_step, run.steps, run.steps_lost) == ("77", 1, 41.0, 0, 26, 2)
    lost, inproc = run.incidents
    assert (lost.mark.label, lost.mark.kind, lost.action, lost.cause) == \
        ("replace (node_failed n2)", "node", "replace", "node_failed")
    assert (lost.reached, lost.resumed_from, lost.steps_lost, lost.recovery_s) == (10, 8, 2, 7.0)  # step 9 at 1022
    assert (inproc.mark.time, inproc.mark.kind, inproc.reached, inproc.resumed_from, inproc.steps_lost,
            inproc.recovery_s) == (1032.5, "inprocess", 19, 19, 0, 1.5)  # from its fault, 0.5 s before its event
    assert [(m.time, m.label, m.kind) for m in run.marks] == [(1014.5, "node_bad n2", "node")]
    assert (run.best_rate, run.rate, run.goodput) == (1.0, round(26 / 41, 4), round(26 / 41, 4))
    assert run.summaries == [{"action": "done", "exit_code": 6, "steps_lost": 2, "lost": "2 step(s) lost"}]


def test_without_a_restore_recorded_the_historys_drop_gives_the_loss(tmp_path):
    events.append(tmp_path, {"event": "decision", "time": 10.0, "action": "relaunch", "cause": "task_failed"})
    (tmp_path / "status.json").write_text(json.dumps({"history": [[5.0, 4], [9.0, 5], [12.0, 0], [13.0, 1]]}))
    (incident,) = summary.read(tmp_path).incidents
    assert (incident.reached, incident.resumed_from, incident.steps_lost, incident.recovered_at) == (5, 0, 5, 13.0)


def test_an_empty_job_directory_is_reported_not_a_crash(tmp_path):
    run = summary.read(tmp_path)
    assert (run.steps, run.incidents, run.wall_s, run.rate, run.best_rate) == (None, [], 0.0, None, None)
    pytest.importorskip("matplotlib")
    assert timeline.draw(tmp_path).is_file()


def test_the_timeline_is_drawn_with_extra_marks(tmp_path):
    pytest.importorskip("matplotlib")
    out = timeline.draw(_job(tmp_path), tmp_path / "plots" / "t.png", marks=[(1014.0, "crash n2", "injected")])
    assert out == tmp_path / "plots" / "t.png" and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "matplotlib.pyplot" not in sys.modules or sys.modules["matplotlib.pyplot"] is not None  # pyplot untouched


def test_the_command_prints_the_summary_and_draws_the_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["report", str(_job(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "step 26 reached" in out and "2 step(s) lost" in out
    assert ("replace (node_failed n2): every rank had reported step 10, resumed from step 8, 2 step(s) lost, "
            "recovered in 7.0 s") in out
    assert f"timeline: {tmp_path / 'timeline.png'}" in out and (tmp_path / "timeline.png").is_file()


def test_without_matplotlib_the_command_still_reports_and_says_how_to_get_the_plot(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    assert main(["report", str(_job(tmp_path)), "--json"]) == 0
    captured = capsys.readouterr()
    said = json.loads(captured.out)
    assert said["png"] is None and "pip install 'hpcft[plots]'" in said["png_missing"]
    assert said["steps"] == 26 and said["incidents"][0]["recovery_s"] == 7.0 and said["steps_lost"] == 2
    assert "pip install 'hpcft[plots]'" in captured.err and not (tmp_path / "timeline.png").exists()
