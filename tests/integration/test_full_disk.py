"""A job directory whose file system fills up (a quota, a full Lustre OST) must not cost the job: the supervisor's
decisions never depend on writing its log (#34). Once, the full disk killed the reports thread, then the supervisor
itself at the next node loss: exit 1, no relaunch, no summary, all progress lost."""
import time

import pytest
from runs import FAULT_AT, assert_same_result, finish, resumed_from, start_spared, wait
from smallfs import fill, shared_fs

HOLD = 12  # the first launch holds after this step until the node is crashed


@pytest.mark.timeout(600)
def test_a_full_job_directory_and_a_node_crash_still_relaunch_resume_from_memory_and_finish(healthy_sandbox,
                                                                                           dp_reference, tmp_path):
    out = tmp_path / "run"
    hold = tmp_path / "go-on"
    with shared_fs(healthy_sandbox, out / "job", mib=40) as job:  # events, status.json and checkpoints/ on it
        proc = start_spared(healthy_sandbox, out, HOLD_AT=str(HOLD), HOLD_FILE=str(hold))
        wait(lambda: _reached(out, 0) >= FAULT_AT, f"step {FAULT_AT}", 120, story=out)
        fill(job)
        wait(lambda: min(_reached(out, r) for r in range(4)) >= HOLD, f"every rank at step {HOLD}", 120, story=out)
        time.sleep(4)  # a few protection rounds for step 12 (the agents' status cannot reach the full disk)
        healthy_sandbox.crash_node("n2")
        hold.touch()
        code, output = finish(proc, timeout=300)
    assert code == 0, output[-4000:]
    assert "replace" in output and "n2:n5" in output, output[-4000:]
    assert set(resumed_from(out).values()) and min(resumed_from(out).values()) > FAULT_AT, resumed_from(out)
    assert_same_result(out, dp_reference)
    summary = [line for line in output.splitlines() if "event=summary" in line][-1]
    assert "WARNING" in summary and "unwritten=" in summary and "not in" in summary, summary
    assert "status.json not updated" in summary, summary
    # said once by each process that writes events (the supervisor, the trainers of two launches), not per event
    assert output.count("cannot write the event record") <= 1 + 2 * 4, output[-4000:]


def _reached(out, rank: int) -> int:
    """The newest step `rank` completed, from the job's own progress file (not on the full disk)."""
    try:
        return int((out / f"progress.{rank}").read_text() or -1)
    except (OSError, ValueError):
        return -1
