"""A Frontier-shaped job in the sandbox: several ranks per node (tensor parallel inside a node, data parallel
across nodes), process groups that refuse CPU tensors as NCCL/RCCL ones do, and a node crash that takes all of that
node's ranks and their /dev/shm at once: the spare takes the slot, the agents rebuild every rank's snapshot of that
node there, and every rank resumes from memory, ending bit-identical (parameters and optimizer state) to a
fault-free run, on the sandbox and on the confined one. That run is `hpcft demo`'s training (its part 4/4,
hpcft/demo.py), which has exactly this shape: the test shows the demo works and checks its run in depth."""
import re

import pytest
from runs import assert_same_ranks, decisions, finish, resumed_from, start

from hpcft import demo, events
from hpcft.report import summary as report

TP, ACTIVE = demo.TP, demo.NODES - 1
RANKS = TP * ACTIVE
JOB_ENV = {"TP": str(TP), "BACKEND": demo.BACKEND}  # TP inside a node; groups like NCCL's
OPTIONS = ("--nodes", str(ACTIVE), "--spares", "1", "--tasks-per-node", str(TP), "--protect", "xor", "--group", "3")


@pytest.fixture(scope="module")
def reference(sandbox, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp-reference")
    code, output = finish(start(sandbox, out, ACTIVE + 1, *OPTIONS, per_node=TP, steps=demo.STEPS, **JOB_ENV),
                          timeout=240)
    assert code == 0, output[-4000:]
    return out


@pytest.mark.parametrize("cluster", ["healthy_sandbox", "healthy_confined_sandbox"])
def test_a_node_crash_takes_all_its_ranks_and_every_rank_resumes_from_memory(cluster, request, reference):
    """On the sandbox, and on the confined one (task/cgroup, each rank its own fake GPU, the reference unconfined):
    there a warm rank is one that joined its trainer step's cgroups, as a child that cannot refuses."""
    healthy_sandbox = request.getfixturevalue(cluster)
    said: list[str] = []
    assert demo.train_through_a_crash(healthy_sandbox, said.append) == 0, "\n".join(said)
    assert any("spare takes the slot" in line for line in said) and any("rebuilt step" in line for line in said)
    out = max((healthy_sandbox.dir / "demo").iterdir())  # the demo's output directory (named by its start time)
    protected = int(re.search(r"have protected step (\d+) on every node", "\n".join(said)).group(1))
    made = decisions(out / "job")
    assert [d["action"] for d in made] == ["replace", "done"], said
    crashed, spare = made[0]["replaced"].split(":")
    slots = next(e for e in events.read(out / "job") if e["event"] == "launch")["slots"].split(",")
    assert crashed == slots[1]  # two ranks (both tp shards of replica 1) and their stores at once
    ready = [e for e in events.read(out / "job") if e["event"] == "agents_ready"]
    assert [e["rebuild"] for e in ready] == [False, True] and ready[1]["rebuilt"] == spare, said
    assert ready[1]["step"] >= protected
    resumed = resumed_from(out)
    assert len(resumed) == RANKS and set(resumed.values()) == {ready[1]["step"]}, resumed
    assert_same_ranks(out, reference, RANKS)
    # `hpcft report` on the job directory, as the demo prints it: the crash, what it cost, the timeline drawn
    (incident,) = report.read(out / "job").incidents
    assert (incident.cause, incident.resumed_from) == ("node_failed", ready[1]["step"]) and incident.recovery_s > 0
    assert any(line.strip().startswith(f"report: replace (node_failed {crashed}): ") and "recovered in" in line
               for line in said), said
    assert f"    timeline: {out / 'job' / 'timeline.png'}" in said and (out / "job" / "timeline.png").is_file()
    # one standby per node serves both of its rank slots, on groups that refuse CPU tensors: the relaunch's ranks
    # (the spare's two among them) are forked children, not new interpreters
    log = events.read(out / "job")
    relaunch = log[[i for i, e in enumerate(log) if e["event"] == "launch"][1]:]
    started = [(e["node"], e["how"]) for e in relaunch if e["event"] == "trainer_start"]
    assert len(started) == RANKS and {how for _, how in started} == {"warm"}, started
    assert sum(node == spare for node, _ in started) == TP, started
    assert not [e for e in log if e["event"] in ("standby_refused", "standby_failed") and e.get("cause") != "step_ended"]
