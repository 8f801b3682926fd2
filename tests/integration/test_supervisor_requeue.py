"""`hpcft submit` in the sandbox: Slurm's warning signal USR1 → requeue → the job runs again and finishes (a USR1
delivered again into the requeued run before its first step is recognised as stale and ignored); spares exhausted
→ the newest snapshot protected, requeue → the restarted job (SLURM_RESTART_COUNT=1) gets the nodes that came back
in their slots, the agents rebuild the lost one and training resumes bit-identical (`hpcft clean` and the
prolog/epilog around a pending requeue: test_slurm_scripts.py); a lost batch host (the session's recovery bench run,
conftest.py) is taken over by a janitor in the same allocation, and so is the successor's own node (a chain), each job
ending COMPLETED."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from runs import (FAULT_AT, agents_ready, assert_same_result, ended, job_state, submit, told, wait, wait_progress,
                  wait_protected)

from hpcft import events
from hpcft.launch.node import succession
from hpcft.launch.node import progress
from hpcft.slurm.state import fields



# 3 active nodes + 1 spare of the 6, so that a requeued job finds nodes even with two crashed
JOB_OPTIONS = ("--nodes", "3", "--spares", "1", "--warn", "60", "--probe-timeout", "5", "--kill-grace", "1")
STEPS = "30"


def _restored(out: Path, run: str) -> set[int]:
    """The steps the ranks of the job's runs `run…` (SLURM_RESTART_COUNT.HPCFT_RESTART_COUNT) resumed from."""
    timeline = [json.loads(line) for line in (out / "timeline.jsonl").read_text().splitlines()]
    return {r["step"] for r in timeline if r["what"] == "restored" and r["run"].startswith(run)}


def _fresh(sandbox, tmp_path: Path) -> tuple:
    """(runner, output directory, job directory) of one test's job."""
    out = tmp_path / "out"
    out.mkdir()
    return sandbox.runner(), out, out / "job"


def _stores(runner, node: str, job: str) -> list[str]:
    """The job's hpcft stores and standby socket directories in `node`'s /dev/shm (each sandbox node has its own)."""
    out = runner.run(["srun", "-N1", "-w", node, "sh", "-c",
                      f"ls -d /dev/shm/hpcft-*-{job} /dev/shm/.standby-hpcft-*-{job} 2>/dev/null; true"])
    return out.stdout.split()


@pytest.fixture(scope="module")
def reference(sandbox, tmp_path_factory) -> Path:
    """The uninterrupted batch job the requeued ones are compared with."""
    runner = sandbox.runner()
    ref = tmp_path_factory.mktemp("reference")
    job = submit(sandbox, ref, *JOB_OPTIONS, STEPS=STEPS)
    wait(lambda: ended(runner, job), "the uninterrupted reference job", 150)
    assert job_state(runner, job) == "COMPLETED", (ref / "job.out").read_text()[-3000:]
    return ref


def test_warning_signal_persists_requeues_and_the_next_run_resumes_from_memory(healthy_sandbox, reference, tmp_path):
    runner, out, job_dir = _fresh(healthy_sandbox, tmp_path)
    job_id = submit(healthy_sandbox, out, *JOB_OPTIONS, "--protect", "xor", "--group", "3", STEPS=STEPS,
                     STEP_DELAY="0.2")
    wait_progress(job_dir, 0, 6)
    runner.run(["scancel", "--signal=USR1", "--batch", job_id])
    # Slurm signals a batch step by job id alone: a late or retried delivery of that signal lands in the requeued
    # run (seen once under load). Deliver one on purpose as soon as the requeued run starts, before its first step.
    wait(lambda: len([e for e in events.read(job_dir) if e["event"] == "start"]) == 2, "the requeued run", 90)
    runner.run(["scancel", "--signal=USR1", "--batch", job_id])
    wait(lambda: ended(runner, job_id), "the requeued job to end", 150)
    assert job_state(runner, job_id) == "COMPLETED", (out / "job.out").read_text()[-3000:]
    recs = events.read(job_dir)
    made = [(e["action"], e["cause"]) for e in recs if e["event"] == "decision"]
    assert made == [("requeue", "walltime"), ("done", "success")], (out / "job.out").read_text()[-3000:]
    starts = [e for e in recs if e["event"] == "start"]
    assert [s["requeues"] for s in starts] == [0, 1]
    signals = [(e["meaning"], e.get("ignored", False)) for e in recs if e["event"] == "signal"]
    assert signals == [("walltime warning", False), ("stale", True)]
    (requeued,) = [e for e in recs if e["event"] == "requeued"]
    assert not requeued["restart"].startswith("after"), requeued  # StartTime=now+5 taken: not Slurm's requeue hold
    # the trainers stopped, the agents protected the newest step they had completed: the next run resumes there
    persist = [e for e in recs if e["event"] == "persist"]
    assert len(persist) == 1 and persist[0]["how"] == "protect+flush" and persist[0]["done"] is True, persist
    assert persist[0]["protected"] >= 6 and persist[0]["durable"] == persist[0]["protected"]
    assert _restored(out, "1.") == {persist[0]["protected"]}
    assert_same_result(out, reference)


def test_spares_exhausted_requeues_and_the_restarted_job_resumes_from_its_nodes_memory(healthy_sandbox, reference,
                                                                                      tmp_path):
    runner, out, job_dir = _fresh(healthy_sandbox, tmp_path)
    job = submit(healthy_sandbox, out, *JOB_OPTIONS, "--protect", "xor", "--group", "3", STEPS=STEPS, STEP_DELAY="0.4")
    # every agent has protected a step (pinned until a newer one is): not "caught up with the trainers", which on a
    # quiet machine may only come once the 30 steps are done, and a crash after the job's end tests nothing
    wait_protected(out, "0", slots=3, timeout=120, above=0)
    first = next(e for e in events.read(job_dir) if e["event"] == "start")
    slots, spare = first["slots"].split(","), first["spares"]
    assert not (out / "final.pt").exists(), "the job ended before its first crash"
    healthy_sandbox.crash_node(slots[1])  # the spare takes its slot and the agents rebuild it there
    wait(lambda: agents_ready(job_dir, "1") is not None, "the agents' rebuild onto the spare", 120, story=out)
    rebuilt = agents_ready(job_dir, "1")["step"]
    wait_progress(job_dir, 0, rebuilt + 3)  # the relaunched run trains on, and its agents protect what it adds
    second = wait_protected(out, "1", slots=3, timeout=120, above=rebuilt)
    assert not ended(runner, job) and not (out / "final.pt").exists(), "the job ended before its second crash"
    healthy_sandbox.crash_node(slots[2])  # no spare left: requeue
    log = lambda: events.read(job_dir)  # noqa: E731
    wait(lambda: sum(e["event"] == "start" for e in log()) == 2 and ended(runner, job), "the restarted job to end", 240,
         story=out)
    assert job_state(runner, job) == "COMPLETED", (out / "job.out").read_text()[-3000:]

    recs = log()
    made = [(e["action"], e["cause"]) for e in recs if e["event"] == "decision"]
    assert made == [("replace", "node_failed"), ("requeue", "node_failed"), ("done", "success")], \
        (out / "job.out").read_text()[-3000:]
    persist = [e for e in recs if e["event"] == "persist"]
    assert len(persist) == 1 and persist[0]["how"] == "protect+flush" and "lost" in persist[0]["reason"]
    assert persist[0]["done"] is False and "cannot flush" in persist[0]["flush_reason"], persist  # the mesh is broken
    # both crashed nodes are kept out: by hpcft's ExcNodeList while Slurm still takes them for healthy, else by Slurm's
    # own DOWN mark, and which of the two it is depends on how long ago each crash was against SlurmdTimeout
    requeued = [e for e in recs if e["event"] == "requeued"]
    assert len(requeued) == 1 and requeued[0]["allowed"] == "", requeued
    assert set(filter(None, requeued[0]["slurm_excluded"].split(","))) <= {slots[1], slots[2]}, requeued
    # one Slurm still took for healthy the job still held: taken out of it, its end waited for no dead node's answer
    assert set(filter(None, requeued[0]["slurm_excluded"].split(","))) <= set(requeued[0]["released"].split(",")), \
        requeued
    restart = [e for e in recs if e["event"] == "start"][1]
    assert restart["requeues"] == 1 and restart["kept"] == f"{slots[0]},{spare}"
    new_slots = restart["slots"].split(",")
    assert new_slots[:2] == [slots[0], spare] and new_slots[2] not in slots + [spare]
    ready = [e for e in recs if e["event"] == "agents_ready"][-1]
    assert ready["rebuild"] is True and ready["rebuilt"] == new_slots[2] and ready["step"] >= second > rebuilt, ready
    # in the restarted job (SLURM_RESTART_COUNT=1) every rank resumes from memory: the epilog (slurm/epilog.sh, the
    # sandbox's Epilog=) kept the stores while the requeue was pending; once the job is over it removes them
    assert _restored(out, "1.") == {ready["step"]}
    assert_same_result(out, reference)
    assert {n: _stores(runner, n, job) for n in new_slots} == {n: [] for n in new_slots}


def test_a_requeued_job_that_lost_nodes_starts_on_those_in_service(healthy_sandbox, tmp_path):
    """Real Slurm: a --no-kill job asking for 4-5 nodes as `hpcft submit` asks (a range, --mincpus) gets 5 of the 6,
    loses two and is requeued: it starts again on the 4 in service, without the lost ones. With a fixed count it
    waited for a repair (~30 s in hpcft chaos; hours in a reservation of its size)."""
    from hpcft.slurm.state import job_info, requeue

    runner = healthy_sandbox.runner()
    job = runner.run(["sbatch", "--parsable", "--requeue", "--no-kill", "--nodes=4-5", "--mincpus=1", "-t", "5",
                      "-o", "/dev/null", "--wrap", "sleep 300"]).stdout.strip()
    try:
        wait(lambda: job_state(runner, job) == "RUNNING", "the job to start", 60)
        held = job_info(runner, job).nodes
        assert len(held) == 5, held  # the top of the range: the nodes are free
        lost = held[1:3]
        for node in lost:
            healthy_sandbox.crash_node(node)
        requeue(runner, job, lost, nodes=5)
        wait(lambda: job_state(runner, job) == "RUNNING" and job_info(runner, job).restarts == 1,
             "the requeued job to start without its lost nodes", 60)
        again = job_info(runner, job).nodes
        assert len(again) == 4 and not set(again) & set(lost), again
    finally:
        runner.run(["scancel", job], check=False)


def test_a_node_slurm_gives_back_to_the_requeued_job_is_used_and_the_job_resumes_from_memory(healthy_sandbox,
                                                                                             reference, tmp_path):
    runner, out, job_dir = _fresh(healthy_sandbox, tmp_path)
    # no spare: a node loss requeues. The node freezes (SIGSTOP of its slurmd, steps and tasks) rather than being
    # killed: a dead host refuses nothing, it stops answering. The agents' heartbeats and the probe find it within
    # about 4 s, before Slurm marks it NOT_RESPONDING (SlurmdTimeout 10 s); hpcft would keep it out of the next
    # allocation, but with the other nodes drained the job could then never start: it stays allowed, and Slurm
    # hands it back once it returns to service. (A node crashed while nodes to spare are in service is kept out:
    # test_spares_exhausted_requeues_and_the_restarted_job_resumes_from_its_nodes_memory.)
    job = submit(healthy_sandbox, out, "--nodes", "3", "--spares", "0", "--warn", "60", "--probe-timeout", "20",
                  "--kill-grace", "1", "--protect", "xor", "--group", "3", STEPS=STEPS, STEP_DELAY="0.4")
    wait(lambda: any(e["event"] == "start" for e in events.read(job_dir)), "the job to start", 90)
    slots = next(e for e in events.read(job_dir) if e["event"] == "start")["slots"].split(",")
    others = [n for n in healthy_sandbox.node_names if n not in slots]  # the requeued job can only get its own
    runner.run(["scontrol", "update", f"NodeName={','.join(others)}", "State=DRAIN", "Reason=hpcft-test"])
    protected = wait_protected(out, "0", slots=3, timeout=120, above=0)
    assert not (out / "final.pt").exists(), "the job ended before its crash"
    for pid in healthy_sandbox.node_pids(slots[1]):
        os.kill(pid, signal.SIGSTOP)
    wait(lambda: any(e["event"] == "requeue" for e in events.read(job_dir)), "the requeue", 120, story=out)
    healthy_sandbox.wait_for([slots[1]], lambda s: s.startswith("down"), "down", 60)
    healthy_sandbox.restart_node(slots[1])  # killed (its memory lost), back in service before the requeued run starts
    wait(lambda: sum(e["event"] == "start" for e in events.read(job_dir)) == 2 and ended(runner, job),
         "the requeued job to end", 240, story=out)
    assert job_state(runner, job) == "COMPLETED", (out / "job.out").read_text()[-3000:]
    recs = events.read(job_dir)
    made = [(e["action"], e["cause"]) for e in recs if e["event"] == "decision"]
    assert made == [("requeue", "node_failed"), ("done", "success")], (out / "job.out").read_text()[-3000:]
    assert [(e["slurm_excluded"], e["allowed"]) for e in recs if e["event"] == "requeued"] == [("", slots[1])]
    assert [e["nodes"] for e in recs if e["event"] == "node_returned"] == [slots[1]]
    assert [e for e in recs if e["event"] == "start"][1]["slots"].split(",") == slots
    ready = [e for e in recs if e["event"] == "agents_ready"][-1]
    assert ready["rebuild"] is True and ready["rebuilt"] == slots[1] and ready["step"] >= protected, ready
    assert _restored(out, "1.") == {ready["step"]}
    assert_same_result(out, reference)
    assert json.loads((job_dir / "state.json").read_text())["excluded"] == []


def test_a_job_that_ends_completed_failed_or_cancelled_leaves_nothing_in_node_memory_without_an_epilog(
        healthy_sandbox, tmp_path):
    assert "Epilog=" not in healthy_sandbox.layout.slurm_conf.read_text()  # as on Frontier: no site epilog of ours
    runner = healthy_sandbox.runner()
    common = ("--nodes", "2", "--spares", "0", "--warn", "60", "--probe-timeout", "5", "--kill-grace", "1")
    kinds = {"completed": ((), {}),
             "failed": (("--hang-timeout", "8", "--start-timeout", "120", "--max-restarts", "0"),
                        {"HANG_AT": "3", "HANG_RANK": "1"}),
             "cancelled": ((), {"HOLD_AT": "3", "HOLD_FILE": str(tmp_path / "never")})}
    jobs = {}
    for name, (options, env) in kinds.items():  # three 2-node jobs side by side on the 6 nodes
        out = tmp_path / name
        out.mkdir()
        jobs[name] = (out, submit(healthy_sandbox, out, *common, *options, STEPS="8", **env))
    wait_progress(jobs["cancelled"][0] / "job", 0, 3)
    runner.run(["scancel", jobs["cancelled"][1]])
    wait(lambda: all(ended(runner, job) for _, job in jobs.values()), "the three jobs to end", 240)
    assert {name: job_state(runner, job) for name, (_, job) in jobs.items()} == {
        "completed": "COMPLETED", "failed": "FAILED", "cancelled": "CANCELLED"}
    nodes = healthy_sandbox.node_names
    # all of a job's files are in its store directory (other tests of the session run jobs without `hpcft run`)
    left = {(n, name): _stores(runner, n, job) for n in nodes for name, (_, job) in jobs.items()}
    assert {k: v for k, v in left.items() if v} == {}
    for name in ("completed", "failed"):
        cleaned = [e for e in events.read(jobs[name][0] / "job") if e["event"] == "cleaned"]
        assert len(cleaned) == 1 and cleaned[0]["exit_code"] == 0, (name, cleaned)
        assert cleaned[0]["by"] == "janitors", cleaned  # the waiting janitors, signalled: no second step


@pytest.mark.timeout(900)  # the session's recovery bench, if no test has made it yet
def test_a_lost_batch_host_is_taken_over_by_a_janitor_and_the_job_completes_without_a_requeue(recovery_bench,
                                                                                              dp_reference):
    # the recovery bench's batch-host run (conftest.py): `hpcft submit --nodes 4 --spares 1 --protect xor`, the batch
    # script's node lost (a power loss: frozen, powered off once a janitor acted) once every agent had protected step
    # FAULT_AT + 1
    out = recovery_bench.runs / "batch-host"
    recs = events.read(out / "job")
    starts = [e for e in recs if e["event"] == "start"]
    assert len(starts) == 2, starts
    slots, spares = starts[0]["slots"].split(","), starts[0]["spares"].split(",")
    lost = [e for e in recs if e["event"] == "batch_host_lost"]
    assert [(e["node"], e["action"], e["generation"]) for e in lost] == [(slots[0], "takeover", 1)], lost
    took = [e for e in recs if e["event"] == "takeover"]
    assert len(took) == 1 and took[0]["lost"] == slots[0] and took[0]["node"] in slots[1:] + spares, took
    assert starts[1]["requeues"] == 0, starts[1]  # the same allocation: no requeue
    made = [(e["action"], e["cause"]) for e in recs if e["event"] == "decision"]
    assert made[0][0] == "replace" and made[-1] == ("done", "success"), made
    launch = [e for e in recs if e["event"] == "launch"][-1]
    assert launch["slots"].split(",") == [spares[0], *slots[1:]], launch  # the spare took the lost slot
    ready = [e for e in recs if e["event"] == "agents_ready"][-1]
    assert ready["rebuild"] is True and ready["rebuilt"] == spares[0], ready
    assert ready["step"] >= FAULT_AT + 1
    summary = [e for e in recs if e["event"] == "summary"]
    assert summary and (summary[-1]["action"], summary[-1]["exit_code"]) == ("done", 0), summary
    assert summary[-1]["supervised_by"] == f"{slots[0]},{took[0]['node']}", summary[-1]
    ended = [e for e in recs if e["event"] == "job_ended"]
    assert ended and ended[-1]["by"] == "slurm_complete_job", ended
    phases = recovery_bench.report["phases"]["batch_host"]
    assert phases["requeued"] is False and phases["job_state"] == "COMPLETED", phases
    status = subprocess.run([sys.executable, "-m", "hpcft.cli", "status", "--json", str(out / "job")],
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["supervisor"] == {"node": took[0]["node"], "generation": 1,
                                                       "took_over_from": slots[0],
                                                       "ended": {"action": "done", "exit_code": 0}}
    assert_same_result(out, dp_reference)


def test_a_chain_of_successors_survives_the_successors_own_node_and_the_job_completes(healthy_sandbox, reference,
                                                                                      tmp_path):
    """The batch host lost (frozen, powered off once a janitor took over), then the node of the janitor that took over
    (generation 1), itself training: generation 2 takes over, a spare each time, and the job ends COMPLETED in the
    same allocation, bit-identical, with no requeue."""
    runner, out, job_dir = _fresh(healthy_sandbox, tmp_path)
    holds = {1: 5, 2: 12}  # launch 0 waits after step 5, launch 1 after step 12: no loss can race the job's end
    job = submit(healthy_sandbox, out, "--nodes", "3", "--spares", "2", "--warn", "60", "--probe-timeout", "5",
                  "--kill-grace", "1", "--protect", "xor", "--group", "3", STEPS=STEPS, STEP_DELAY="0.1",
                  HOLD_AT=",".join(map(str, holds.values())), HOLD_FILE=f"{out}/never0,{out}/never1")
    log = lambda: events.read(job_dir)  # noqa: E731
    for generation in (1, 2):
        tag = str(generation - 1)  # the launch whose agents must have protected its hold step before its node goes
        wait_progress(job_dir, 0, holds[generation], timeout=120)
        wait_protected(out, tag, slots=3, timeout=120, above=holds[generation] - 1)
        host = succession.read(job_dir).host
        slots = [e for e in log() if e["event"] == "launch"][-1]["slots"].split(",")
        assert host in slots, (host, slots)  # the supervisor's node trains: its loss is a node loss too
        healthy_sandbox.freeze_node(host)
        wait(lambda: any(e["event"] == "takeover" and e["generation"] == generation for e in log()),
             f"generation {generation} to take over", 120, story=out)
        healthy_sandbox.crash_node(host)
        wait(lambda: agents_ready(job_dir, str(generation)) is not None, "the successor's agents", 120, story=out)
    wait(lambda: ended(runner, job), "the job to end", 240, story=out)
    assert job_state(runner, job) == "COMPLETED", told(out)
    recs = log()
    lost = [(e["generation"], e["action"]) for e in recs if e["event"] == "batch_host_lost"]
    assert lost == [(1, "takeover"), (2, "takeover")], lost
    made = [(e["action"], e["cause"]) for e in recs if e["event"] == "decision"]
    assert made == [("replace", "node_failed"), ("replace", "node_failed"), ("done", "success")], made
    assert all(e["requeues"] == 0 for e in recs if e["event"] == "start")
    assert not [e for e in recs if e["event"] == "node_returned"]  # a lost node is lost for its whole allocation
    took = [e for e in recs if e["event"] == "takeover"]
    summary = [e for e in recs if e["event"] == "summary"]
    assert summary[-1]["supervised_by"] == f"{took[1]['lost']},{took[1]['node']}" and \
        took[1]["lost"] == took[0]["node"], (took, summary[-1])
    assert [e["by"] for e in recs if e["event"] == "job_ended"] == ["slurm_complete_job"]
    assert_same_result(out, reference)


def test_a_job_requeued_onto_other_nodes_resumes_from_the_durable_tier(healthy_sandbox, reference, tmp_path):
    """Frontier's case: the requeued job gets entirely other nodes (here its first nodes are drained), whose memory
    holds nothing; the checkpoint the agents flushed before the requeue (through each node's own first level,
    `$SLURMD_NODENAME` expanded on the node, then drained) is where it resumes, bit-identical. The drain of the
    running nodes is an admin's, not a failure: the trainers and agents go on until the walltime warning (CI once
    lost the race between drain and warning, when a drain stopped the step as a node loss and nothing was
    flushed)."""
    runner, out, job_dir = _fresh(healthy_sandbox, tmp_path)
    nvme = tmp_path / "nvme"  # the sandbox's nodes share /tmp: a directory per node stands for each one's NVMe
    job_id = submit(healthy_sandbox, out, "--nodes", "3", "--warn", "60", "--probe-timeout", "5", "--kill-grace",
                     "1", "--slurm-check-every", "1", "--protect", "xor", "--group", "3", "--persist-local",
                     f"{nvme}/$SLURMD_NODENAME",
                     STEPS=STEPS, STEP_DELAY="0.3")
    wait_progress(job_dir, 0, 6)
    first = fields(runner.run(["scontrol", "show", "job", "-o", job_id]).stdout)["NodeList"]
    # the job trains ~10 s more: the drain is seen on a 1 s slow timer here (--slurm-check-every; 60 s by default)
    runner.run(["scontrol", "update", f"NodeName={first}", "State=DRAIN", "Reason=hpcft-test"])
    slots = next(e for e in events.read(job_dir) if e["event"] == "start")["slots"].split(",")
    wait(lambda: {e["node"] for e in events.read(job_dir) if e["event"] == "node_closed"} == set(slots),
         "the supervisor to see the drain", 60, story=out)
    reached = lambda: min(progress.read(job_dir).get(rank, (-1, 0))[0] for rank in range(3))  # noqa: E731
    step = reached()
    wait(lambda: reached() > step, "the trainers to go on on the drained nodes", 60, story=out)
    runner.run(["scancel", "--signal=USR1", "--batch", job_id])
    wait(lambda: ended(runner, job_id), "the requeued job to end", 200)
    assert job_state(runner, job_id) == "COMPLETED", (out / "job.out").read_text()[-3000:]
    recs = events.read(job_dir)
    starts = [e for e in recs if e["event"] == "start"]
    assert len(starts) == 2 and not set(starts[0]["slots"].split(",")) & set(starts[1]["slots"].split(","))
    made = [(e["action"], e["cause"]) for e in recs if e["event"] == "decision"]
    assert made == [("requeue", "walltime"), ("done", "success")], made
    persist = next(e for e in recs if e["event"] == "persist")
    assert persist["done"] is True and persist["durable"] >= 6, json.dumps(persist)  # a str: pytest cuts a dict short
    assert _restored(out, "1.") == {persist["durable"]}
    source = [e for e in recs if e["event"] == "restore_source"]
    assert source and source[-1]["source"] == "durable" and "node-local" in source[-1]["reason"], source
    for node in starts[0]["slots"].split(","):  # each first node drained its own copy of the requeue's flush
        assert (nvme / node / f"step-{persist['durable']}").is_dir(), sorted(nvme.glob("*/*"))
    assert_same_result(out, reference)
