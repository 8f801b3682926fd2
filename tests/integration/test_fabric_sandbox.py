"""The shared file system under `hpcft run` (issue #16 item 3): a protected run with several tasks per node writes
nothing per step under its job directory but the supervisor's bounded log (status.json, at most about once a second)
and one events line per protected step; the progress and the agents' status reach the supervisor over the network,
and `hpcft status` reads them from the log after the run. The same without agents: the nodes' reporters carry the
progress."""
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from runs import decisions, finish, start

from hpcft import events
from hpcft.launch.node import progress

STEPS, DELAY, TASKS = 50, 0.25, 2
ALLOWED = {"status.json", "events.jsonl"}  # the supervisor's own files, one writer each


def _scan(job: Path) -> dict[str, tuple[int, int]]:
    """{path under the job dir: (mtime_ns, size)} of every file there (a file replaced meanwhile is skipped)."""
    found = {}
    for p in job.rglob("*"):
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        if p.is_file() and not p.name.startswith(".status.json."):  # the log's own temporary file
            found[str(p.relative_to(job))] = (st.st_mtime_ns, st.st_size)
    return found


def _watch(job: Path, world: int, done: threading.Event, seen: list) -> None:
    """Every 0.2 s, while every rank is between step 5 and step STEPS - 5: (wall time, min step, the scan)."""
    while not done.is_set():
        steps = [s for s, _ in progress.read(job).values()] if (job / "status.json").exists() else []
        if len(steps) == world and 5 <= min(steps) <= STEPS - 5:
            seen.append((time.time(), min(steps), _scan(job)))
        time.sleep(0.2)


def test_a_protected_run_with_several_tasks_per_node_writes_nothing_per_step_under_the_job_dir(sandbox, tmp_path):
    out = tmp_path / "run"
    proc = start(sandbox, out, 3, "--nodes", "3", "--protect", "xor", "--group", "3", "--tasks-per-node", str(TASKS),
                 "--hang-timeout", "120", per_node=TASKS, steps=STEPS, delay=DELAY)
    job, seen, done = out / "job", [], threading.Event()
    watcher = threading.Thread(target=_watch, args=(job, 3 * TASKS, done, seen), daemon=True)
    watcher.start()
    try:
        code, output = finish(proc, timeout=300)
    finally:
        done.set()
        watcher.join(5)
    assert code == 0, output[-4000:]
    assert [d["action"] for d in decisions(job)] == ["done"], output[-4000:]
    assert len(seen) >= 10, f"the run was watched {len(seen)} times only"
    (t0, step0, first), (t1, step1, last) = seen[0], seen[-1]
    window, steps = t1 - t0, step1 - step0
    assert steps >= 10, (step0, step1)
    assert set(last) == set(first), f"files appeared or went while the job trained: {set(last) ^ set(first)}"
    changes = {path: len({scan[path] for _, _, scan in seen}) - 1 for path in first}
    moved = {path for path, n in changes.items() if n}
    assert moved <= ALLOWED, f"written while the job trained: {moved - ALLOWED}"
    assert 2 <= changes["status.json"] <= 1.5 * window + 2, (changes["status.json"], window)  # live, ≤ ~1 Hz
    lines = [e for e in events.read(job) if t0 <= e["time"] <= t1]
    assert sum(e["event"] == "snapshot_protected" for e in lines) <= steps + 2, lines[-10:]  # one per step, all nodes
    assert all(e.get("slots") == 3 for e in events.read(job) if e["event"] == "snapshot_protected")
    assert not (job / "progress").exists() and not list((job / "agents").glob("*.status"))
    status = subprocess.run([sys.executable, "-m", "hpcft.cli", "status", "--json", str(job)], capture_output=True,
                            text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    view = json.loads(status.stdout)
    assert [n["phase"] for n in view["nodes"]] == ["stopped"] * 3, "\n".join(
        json.dumps(e) for e in events.read(job) if e["event"] in ("agents_stopped", "agent_failed", "decision"))
    assert {r: s for r, (s, _) in progress.read(job).items()} == dict.fromkeys(range(3 * TASKS), STEPS)


def test_without_agents_each_nodes_reporter_carries_its_ranks_progress(sandbox, tmp_path):
    out = tmp_path / "bare"
    proc = start(sandbox, out, 2, "--nodes", "2", "--protect", "none", "--persist-dir", "none", "--tasks-per-node",
                 str(TASKS), "--hang-timeout", "120", per_node=TASKS, steps=12, delay=DELAY)
    code, output = finish(proc, timeout=240)
    assert code == 0, output[-4000:]
    got = {r: s for r, (s, _) in progress.read(out / "job").items()}
    assert sorted(got) == list(range(2 * TASKS)) and min(got.values()) >= 8, got  # reported each second
    assert not (out / "job" / "progress").exists()
