"""In-process restart in Frontier's shape, under `hpcft run`: two ranks per node, a rank on the second node raises
(every rank restarts in process, the same processes), then the first node, which holds rank 0 and the restart
coordinator's store, crashes: in-process restart cannot help without its store, the survivors give up or are
stopped, the spare takes the slot, and every rank resumes from memory. The result is the fault-free run's, bit for
bit (4 data-parallel ranks on 2 nodes × 2 compute what 4 ranks on 4 nodes do)."""
import json

import pytest
from runs import assert_same_result, decisions, finish, start, told, wait, wait_protected

from hpcft import events

RAISE_AT, RAISE_RANK, HOLD_AT = 3, 3, 9  # rank 3: the second node's second rank


def _records(out, what: str) -> list[dict]:
    path = out / "timeline.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(json.loads, filter(str.strip, lines)) if r.get("what") == what]


@pytest.mark.timeout(420)
def test_a_raise_restarts_every_rank_in_process_and_the_coordinators_node_crash_falls_back_to_a_relaunch(
        healthy_sandbox, dp_reference, tmp_path):
    out = tmp_path / "inprocess"
    hold = out / "crashed"
    proc = start(healthy_sandbox, out, 3, "--nodes", "2", "--spares", "1", "--tasks-per-node", "2", per_node=2,
                 minutes=8, RAISE_AT=str(RAISE_AT), RAISE_RANK=str(RAISE_RANK), MAX_RESTARTS="2",
                 HOLD_AT=str(HOLD_AT), HOLD_FILE=str(hold))
    try:
        wait(lambda: {r["rank"] for r in _records(out, "step") if r["step"] == HOLD_AT} == {0, 1, 2, 3},
             "every rank at the hold", 180, story=out)
        launch = next(e for e in events.read(out / "job") if e["event"] == "launch")
        first = launch["slots"].split(",")[0]
        wait_protected(out, slots=2, timeout=120, above=HOLD_AT)  # the snapshot of the hold: nothing to lose
        healthy_sandbox.crash_node(first)  # rank 0 and 1, their /dev/shm and the coordinator's TCPStore at once
    finally:
        hold.touch()
    code, output = finish(proc, timeout=300)
    assert code == 0, output[-4000:] + told(out)

    restarts = [e for e in events.read(out / "job") if e["event"] == "inprocess_restart"]
    assert sorted(int(e["rank"]) for e in restarts) == [0, 1, 2, 3], restarts  # once each, every rank
    inits = [r for r in _records(out, "init") if r.get("gen") == 1]
    started = {r["rank"]: r["pid"] for r in _records(out, "start") if r["run"] == "0.0"}
    assert sorted(r["rank"] for r in inits) == [0, 1, 2, 3]
    assert all(started[r["rank"]] == r["pid"] for r in inits), "generation 1 ran in the first launch's processes"
    # nothing lost: generation 1 restores one step, no older than the newest every rank said it completed (a step
    # record follows that step's snapshot start, which the interrupt does not cut) and no newer than the raise. A
    # rank still in step RAISE_AT - 1 when rank 3 raised has no snapshot RAISE_AT: CI once saw ranks 1 and 2 cut
    # in their optimizer step, and every rank rightly restored RAISE_AT - 1.
    gen0 = [r for r in _records(out, "step") if r["run"] == "0.0" and r.get("gen") == 0]  # the first launch's
    done = min(max(r["step"] for r in gen0 if r["rank"] == rank) for rank in range(4)) + 1  # loop step s: snapshot s+1
    restored = {r["step"] for r in _records(out, "restored") if r.get("gen") == 1}
    assert len(restored) == 1 and done <= min(restored) <= RAISE_AT, \
        f"nothing lost (every rank completed {done}): " + "\n".join(
            json.dumps(r) for w in ("step", "raise", "restored") for r in _records(out, w) if r["step"] <= RAISE_AT) \
        + told(out)

    gave_up = [e for e in events.read(out / "job") if e["event"] == "inprocess_giveup"]
    # the second node's ranks find the store gone (or are stopped by the relaunch first): said, at ERROR
    assert {int(e["rank"]) for e in gave_up} <= {2, 3} and all(e["level"] == "ERROR" for e in gave_up), gave_up
    assert all("store lost" in e["reason"] for e in gave_up), gave_up
    made = decisions(out / "job")
    assert [d["action"] for d in made] == ["replace", "done"], made
    assert made[0]["replaced"].startswith(f"{first}:"), made[0]
    resumed = {r["rank"]: r["step"] for r in _records(out, "restored") if r["run"] == "0.1"}
    assert sorted(resumed) == [0, 1, 2, 3] and len(set(resumed.values())) == 1, resumed
    assert min(resumed.values()) > RAISE_AT, resumed  # the protected step, from memory (the spare's rebuilt)
    summary = next(e for e in events.read(out / "job") if e["event"] == "summary")
    assert summary["inprocess_restarts"] == 1 and summary["lost"] == "", summary
    assert_same_result(out, dp_reference)
