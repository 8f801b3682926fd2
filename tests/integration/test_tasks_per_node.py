"""A Frontier-shaped job in the sandbox: several ranks per node (tensor parallel inside a node, data parallel
across nodes), process groups that refuse CPU tensors as NCCL/RCCL ones do, and a node crash that takes all of that
node's ranks and their /dev/shm at once: the spare takes the slot, the agents rebuild every rank's snapshot of that
node there, and every rank resumes from memory, ending bit-identical (parameters and optimizer state) to a
fault-free run."""
import pytest
from runs import assert_same_ranks, decisions, finish, resumed_from, start, wait_protected

from hpcft import events

TP, ACTIVE = 2, 3
RANKS = TP * ACTIVE
JOB_ENV = {"TP": str(TP), "BACKEND": "cuda:gloo"}  # TP inside a node; groups like NCCL's
OPTIONS = ("--nodes", str(ACTIVE), "--spares", "1", "--tasks-per-node", str(TP), "--protect", "xor", "--group", "3")


@pytest.fixture(scope="module")
def reference(sandbox, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp-reference")
    code, output = finish(start(sandbox, out, ACTIVE + 1, *OPTIONS, per_node=TP, **JOB_ENV), timeout=240)
    assert code == 0, output[-4000:]
    return out


def test_a_node_crash_takes_all_its_ranks_and_every_rank_resumes_from_memory(healthy_sandbox, reference, tmp_path):
    out = tmp_path / "crash"
    proc = start(healthy_sandbox, out, ACTIVE + 1, *OPTIONS, per_node=TP, delay=0.5, **JOB_ENV)
    protected = wait_protected(out, slots=ACTIVE, timeout=150, above=0)
    assert not (out / "final.pt").exists(), "the job ended before its crash"
    slots = next(e for e in events.read(out / "job") if e["event"] == "launch")["slots"].split(",")
    healthy_sandbox.crash_node(slots[1])  # two ranks (both tp shards of replica 1) and their stores at once
    code, output = finish(proc, timeout=240)
    assert code == 0, output[-4000:]
    made = decisions(out / "job")
    assert [d["action"] for d in made] == ["replace", "done"], output[-4000:]
    spare = made[0]["replaced"].split(":")[1]
    ready = [e for e in events.read(out / "job") if e["event"] == "agents_ready"]
    assert [e["rebuild"] for e in ready] == [False, True] and ready[1]["rebuilt"] == spare, output[-4000:]
    assert ready[1]["step"] >= protected
    resumed = resumed_from(out)
    assert len(resumed) == RANKS and set(resumed.values()) == {ready[1]["step"]}, resumed
    assert_same_ranks(out, reference, RANKS)
