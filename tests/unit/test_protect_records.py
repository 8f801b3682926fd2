"""Record files: retired data files are recycled (their faulted-in pages reused), never left torn."""

import time

import pytest

from hpcft.agent.protection.protect import SPARE, drop_orphans, record_slot, retire


def test_a_retired_record_file_becomes_the_next_pass_data_file(tmp_path):
    for step in (1, 2, 3):
        (tmp_path / f"step-{step}.json").write_text("{}")
        (tmp_path / f"step-{step}.data").write_bytes(bytes([step]) * 4096)
        (tmp_path / f"step-{step}.data").chmod(0o600)  # as the store creates them
    (tmp_path / "step-9.data").write_bytes(b"x")  # a dead pass's data without a record
    retire(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        SPARE, "step-2.data", "step-2.json", "step-3.data", "step-3.json"]
    slot = record_slot(tmp_path, 4)
    try:
        assert slot.size == 4096 and not (tmp_path / SPARE).exists()
    finally:
        slot.close()
    assert (tmp_path / "step-4.data").exists()


def test_at_start_only_the_data_files_without_a_record_go(tmp_path):
    """Three records after two passes failed their barrier (4 protected everywhere, 5 and 6 here only): all stay."""
    for step in (4, 5, 6):
        (tmp_path / f"step-{step}.json").write_text("{}")
        (tmp_path / f"step-{step}.data").write_bytes(b"r")
    (tmp_path / "step-7.data").write_bytes(b"x")  # a dead pass's data without a record
    drop_orphans(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        SPARE, "step-4.data", "step-4.json", "step-5.data", "step-5.json", "step-6.data", "step-6.json"]


def test_protection_lag_in_steps_and_seconds() -> None:
    from types import SimpleNamespace

    from hpcft.agent.agent import protection_lag

    def held(t):
        return {0: SimpleNamespace(manifest={"time": t}), 1: SimpleNamespace(manifest={"time": t + 0.1})}

    complete = {3: held(100.0), 4: held(101.5), 7: held(106.25)}
    assert protection_lag(complete, [1, 4]) == (3, 4.75)
    assert protection_lag(complete, []) == (None, None)
    assert protection_lag(complete, [2]) == (5, None)  # protected, since recycled by the trainers: the lag counts
    assert protection_lag({}, [4]) == (None, None)


def test_a_lag_bound_raises_the_cpu_cap_to_its_ceiling_and_lowers_it_back() -> None:
    from hpcft.agent.protection.budget import UNMET_ROUNDS, LagBudget

    b = LagBudget(floor=0.01, ceiling=0.08, bound=3)
    assert b.update(None) == (0.01, False)  # nothing protected yet: nothing to measure
    caps = [b.update(10)[0] for _ in range(3)]
    assert caps == [0.02, 0.04, 0.08]
    unmet = [b.update(10)[1] for _ in range(UNMET_ROUNDS + 1)]
    assert unmet == [False] * (UNMET_ROUNDS - 1) + [True, False]  # said once, after UNMET_ROUNDS at the ceiling
    assert b.update(3) == (0.08, False)  # within the bound: kept
    assert b.update(1)[0] == 0.08 / 1.5 and b.update(0)[0] == 0.08 / 1.5 / 1.5
    for _ in range(10):
        b.update(0)
    assert b.cap == 0.01  # never below the budget given
    assert LagBudget(floor=0, ceiling=1, bound=3).update(50) == (0, False)  # uncapped stays uncapped


def test_a_lag_bound_steers_by_the_lag_the_next_pass_will_leave_and_shortens_the_wait() -> None:
    from hpcft.agent.protection.budget import foreseen_lag, pause

    # passes of 1 s (a capped agent) against steps of 0.4 s: lag 2 now is 2 + 1 + 3 when the next pass ends
    assert foreseen_lag(2, 0.4, 1.0) == 6 and foreseen_lag(1, 0.4, 0.05) == 3 and foreseen_lag(None, 0.4, 1) is None
    assert pause(1.0, None, 0, 0.4, 0.1) == 1.0  # no bound: the interval
    assert pause(1.0, 3, 0, 0.4, 0.1) == pytest.approx(0.7)  # 2 steps of slack, less the round's own time
    assert pause(1.0, 3, 2, 0.4, 0.1) == 0.0 and pause(1.0, 30, 0, 0.4, 0.1) == 1.0
    assert pause(1.0, 3, 0, None, 0.1) == 1.0  # pace unknown (one snapshot so far)


def test_work_run_unbilled_or_on_a_chore_thread_is_not_charged_to_the_cpu_cap() -> None:
    """A flush (its thread a chore, slot 0's commit `unbilled`) once charged ~2 CPU-s to a 0.01-core cap."""
    from hpcft.agent.transport.throttle import billed_cpu, chore, unbilled

    def burn(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    before = billed_cpu()
    with unbilled():
        burn(0.3)
    t = chore(burn, 0.3, name="test-burn")
    t.start()
    t.join()
    assert billed_cpu() - before < 0.1
    burn(0.2)
    assert billed_cpu() - before >= 0.2
