"""Stragglers in the sandbox (#14 item 4): a node whose trainer is made slow by SIGSTOP/SIGCONT bursts is named a
straggler and, with --evict-stragglers, replaced by a spare at a protected step; the run ends bit-identical to the
fault-free one. A node paused once, for less than the loss timeout, is not named."""
import json
import os
import re
import signal
import threading
import time

from runs import assert_same_result, decisions, finish, start_spared, told, wait

from hpcft import events


def _pid(out, rank: int) -> int | None:
    """The pid of `rank`'s trainer in the first launch, once it has completed a step (timeline.jsonl)."""
    path = out / "timeline.jsonl"
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        rec = json.loads(line) if line.strip() else {}
        if rec.get("what") == "step" and rec.get("rank") == rank and rec.get("run") == "0.0":
            return rec["pid"]
    return None


def _bursts(pid: int, stop: threading.Event, paused_s: float = 0.5, running_s: float = 0.2) -> None:
    """SIGSTOP/SIGCONT `pid` in turn until `stop` is set or the process is gone; it is left running."""
    try:
        while not stop.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(paused_s)
            os.kill(pid, signal.SIGCONT)
            time.sleep(running_s)
    except ProcessLookupError:
        return
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def test_a_slowed_node_is_named_a_straggler_and_evicted_onto_a_spare_a_short_pause_is_not(healthy_sandbox,
                                                                                         dp_reference, tmp_path):
    out = tmp_path / "straggler"
    hold = out / "evicted"
    # the trainers hold after step 13 of the first launch until the eviction: the 16 steps must not end before it
    proc = start_spared(healthy_sandbox, out, "--evict-stragglers", "--straggler-window", "4", "--loss-timeout", "5",
                        delay=0.2, verbose=False, HOLD_AT="13", HOLD_FILE=str(hold))
    stop = threading.Event()
    burst = None
    try:
        wait(lambda: _pid(out, 1) and _pid(out, 2), "the first steps", 120, story=out)
        os.kill(_pid(out, 2), signal.SIGSTOP)  # n3's trainer paused once, for less than the loss timeout
        time.sleep(2.0)
        os.kill(_pid(out, 2), signal.SIGCONT)
        burst = threading.Thread(target=_bursts, args=(_pid(out, 1), stop), daemon=True)  # n2's trainer: slow
        burst.start()
        wait(lambda: any(d["action"] == "evict" for d in decisions(out / "job")), "the eviction", 150, story=out)
    finally:
        stop.set()
        if burst is not None:
            burst.join(timeout=5)
        hold.touch()
    code, output = finish(proc, timeout=240)
    assert code == 0, output[-4000:] + told(out)
    log = events.read(out / "job")
    named = [e for e in log if e["event"] == "straggler"]
    assert [(e["node"], e["ranks"]) for e in named] == [("n2", "1")], named  # n3's one pause was not a straggler
    assert named[0]["level"] == "WARNING" and named[0]["ratio"] > 1.5 and named[0]["action"].startswith("evict")
    made = decisions(out / "job")
    assert [(d["action"], d["cause"]) for d in made] == [("evict", "straggler"), ("done", "success")], made
    assert made[0]["replaced"] == "n2:n5" and "n2" in made[0]["excluded"], made[0]
    assert f"step {named[0]['step']}" in made[0]["reason"] or "protected" in made[0]["reason"]
    assert not [e for e in log if e["event"] == "node_bad"], "the straggler was never declared failed"
    ready = [(e["tag"], e["rebuild"]) for e in log if e["event"] == "agents_ready"]
    assert ready[-1][1] and "n5" in next(e for e in log if e["event"] == "agents_ready" and e["rebuild"])["rebuilt"]
    summary = next(e for e in log if e["event"] == "summary")
    # the steps the trainers made past the protected step are redone, and said (WARNING), now that the supervisor's
    # view of progress is exact (the agents report it until stopped); nothing protected is lost: the resume is from
    # the step protected at the decision or a newer one the agents protected before they stopped (CI: 6, then 7)
    protected = int(re.search(r"step (\d+) protected", made[0]["reason"]).group(1))
    resumed = re.search(r"resumed from step (\d+) after", summary["lost"])
    assert summary["lost"] == "" or (resumed and int(resumed.group(1)) >= protected), summary
    assert_same_result(out, dp_reference)
    print(f"\nstraggler: named {named[0]['time'] - min(e['time'] for e in log if e['event'] == 'launch'):.1f} s after "
          f"the launch (ratio {named[0]['ratio']}), evicted {made[0]['time'] - named[0]['time']:.1f} s after that")
