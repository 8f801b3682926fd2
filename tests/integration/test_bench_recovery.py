"""`hpcft bench recovery --json` in the sandbox with a small model (the session's `recovery_bench`, conftest.py):
one JSON object on stdout with every figure, each recovery split into phases that add up to its total. What hpcft
did in those runs is checked by the tests of each recovery (test_supervisor.py, test_supervisor_requeue.py)."""
import pytest
from hpcft import events
from runs import FAULT_AT, assert_same_result, decisions

pytestmark = pytest.mark.sandbox

KEYS = {"rank_kill_s", "node_crash_s", "node_crash_from_fault_s", "restore_share", "baseline_relaunch_s",
        "baseline_relaunch_over_rank_kill", "batch_host_s", "batch_host_total_s", "batch_host_requeued", "exception_s",
        "identical", "phases", "targets", "met", "config"}


@pytest.mark.timeout(900)  # four recoveries in a row and a baseline
def test_recovery_bench_reports_every_figure_as_json(recovery_bench):
    report = recovery_bench.report
    assert KEYS <= report.keys() and report["bench"] == "recovery"
    assert "rank kill" in recovery_bench.stderr  # the human table goes to stderr with --json
    assert "baseline_requeue_s" not in report  # not asked for (--baseline relaunch)
    for name in ("rank_kill", "node_crash", "batch_host", "baseline_relaunch"):
        ph = report["phases"][name]
        parts = ph["detection_s"] + ph["relaunch_s"] + ph["restore_s"] + ph["first_step_s"]
        assert parts == pytest.approx(ph["total_s"], abs=1e-6)
        assert ph["detection_s"] > 0 and ph["first_step_s"] > 0
    assert report["phases"]["rank_kill"]["resumed_from"] >= FAULT_AT  # from node memory, after the fault step
    # from the torch.save checkpoint, by the script's second srun in the same allocation
    assert report["phases"]["baseline_relaunch"]["resumed_from"] >= FAULT_AT
    assert report["phases"]["batch_host"]["resumed_from"] >= FAULT_AT  # the survivors' memory, the lost slot rebuilt
    # a janitor took the supervision over in the same allocation; it may act before Slurm marks the node (a probe):
    # batch_host_s, from Slurm's mark to the janitor's act, is then negative
    assert report["batch_host_requeued"] is False and report["phases"]["batch_host"]["job_state"] == "COMPLETED"
    # the bench's own check: each faulted run ended as its fault-free run did, bit for bit
    assert report["identical"] is True and report["met"]["identical"] is True
    assert all(report["phases"][name]["resumed_identical"] for name in ("rank_kill", "exception", "node_crash",
                                                                         "batch_host"))
    assert 0 <= report["restore_share"] < 1


@pytest.mark.timeout(900)  # the session's recovery bench, if no test has made it yet
def test_an_exception_restarts_in_process_without_a_relaunch_and_ends_bit_identical(recovery_bench, dp_reference):
    """The bench's `exception_s` run: rank 2 raised at step FAULT_AT under hpcft.restartable; every rank restarted in
    the same process (no supervisor decision but the end), restored the step it had, and the result is the
    uninterrupted run's, bit for bit."""
    out = recovery_bench.runs / "exception"
    assert [d["action"] for d in decisions(out / "job")] == ["done"]
    summary = next(e for e in events.read(out / "job") if e["event"] == "summary")
    assert summary["inprocess_restarts"] == 1 and summary["level"] == "WARNING"  # the ranks told it
    ph = recovery_bench.report["phases"]["exception"]
    parts = ph["detection_s"] + ph["abort_barrier_s"] + ph["new_groups_s"] + ph["restore_s"] + ph["first_step_s"]
    assert parts == pytest.approx(ph["total_s"], abs=1e-6) and ph["first_step_s"] > 0
    assert ph["resumed_from"] == FAULT_AT  # the step every rank had completed: nothing lost
    assert recovery_bench.report["exception_s"] == ph["total_s"]
    assert_same_result(out, dp_reference)
