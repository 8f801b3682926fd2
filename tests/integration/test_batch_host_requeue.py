"""A lost batch host where no successor may run (`--no-takeover`): the janitor that claims the supervision requeues
the job as `hpcft run` would, the lost node kept out of the next allocation where Slurm still takes it for healthy (a
large machine marks a dead node only after SlurmdTimeout, often minutes, while a requeued job may start 5 s after
the requeue: its batch script could be sent to the dead node), what Slurm took written to state.json; the
requeued run starts elsewhere and resumes from the surviving nodes' memory, bit-identical."""
import json

import pytest
from runs import assert_same_result, ended, job_state, submit, told, wait, wait_progress, wait_protected

from hpcft import events
from hpcft.launch.node import succession

HOLD = 8  # the first run waits after this step: the batch host is lost while it trains, never after its end


@pytest.fixture(scope="module")
def reference(sandbox, tmp_path_factory):
    ref = tmp_path_factory.mktemp("reference")
    job = submit(sandbox, ref, "--nodes", "3", "--spares", "1", "--warn", "60", STEPS="20")
    wait(lambda: ended(sandbox.runner(), job), "the uninterrupted reference job", 150)
    return ref


def test_a_lost_batch_host_without_a_successor_is_requeued_by_a_janitor_off_that_node(healthy_sandbox, reference,
                                                                                      tmp_path):
    runner, out = healthy_sandbox.runner(), tmp_path / "out"
    out.mkdir()
    job = submit(healthy_sandbox, out, "--nodes", "3", "--spares", "1", "--warn", "60", "--no-takeover",
                 "--probe-timeout", "5", "--kill-grace", "1", "--protect", "xor", "--group", "3", STEPS="20",
                 STEP_DELAY="0.1",
                 HOLD_AT=str(HOLD), HOLD_FILE=str(out / "never"))
    wait_progress(out / "job", 0, HOLD, timeout=120)
    wait_protected(out, "0", slots=3, timeout=120, above=HOLD - 1)
    host = succession.read(out / "job").host
    log = lambda: events.read(out / "job")  # noqa: E731
    healthy_sandbox.freeze_node(host)  # a power loss, as its peers see it: Slurm takes the node for healthy a while
    wait(lambda: any(e["event"] == "requeued" and e.get("by") == "janitor" for e in log()), "a janitor's requeue", 120,
         story=out)
    healthy_sandbox.crash_node(host)
    wait(lambda: ended(runner, job), "the requeued job to end", 240, story=out)
    assert job_state(runner, job) == "COMPLETED", told(out)
    recs = log()
    lost = [(e["node"], e["action"]) for e in recs if e["event"] == "batch_host_lost"]
    assert lost == [(host, "requeue")], lost
    (requeued,) = [e for e in recs if e["event"] == "requeued"]
    # kept out by ExcNodeList while Slurm took it for healthy; marked by Slurm already (SlurmdTimeout is 10 s here, the
    # janitor's verdict takes the loss timeout and a probe), Slurm keeps it out itself until it is back
    assert requeued["lost"] == host and (host in requeued["slurm_excluded"].split(",") or (
        f"{host} (" in requeued["reason"] and "Slurm itself reports it out of service" in requeued["reason"])), requeued
    assert not requeued["restart"].startswith("after"), requeued  # StartTime=now+5 taken: not Slurm's requeue hold
    assert json.loads((out / "job" / "state.json").read_text())["slurm_excluded"] == \
        [n for n in requeued["slurm_excluded"].split(",") if n]
    starts = [e for e in recs if e["event"] == "start"]
    assert [s["requeues"] for s in starts] == [0, 1], starts
    assert host not in starts[1]["slots"].split(",") + starts[1]["spares"].split(","), starts[1]
    restored = {e["step"] for e in recs if e["event"] == "restore_done"}
    assert len(restored) == 1 and restored.pop() >= HOLD, told(out)  # from the memory of the nodes that trained
    assert_same_result(out, reference)
