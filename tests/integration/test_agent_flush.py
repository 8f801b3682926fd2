"""The agents' flush to the durable tier, with real agent processes on this machine: two "nodes" (each its own
store root, two data-parallel ranks each, snapshots written by real Checkpointers). A flushed checkpoint loads with
plain torch.distributed.checkpoint.load and equals the trained state bit for bit; an agent killed in the middle of
a flush (here: of the drain from its node-local first level) leaves the previous checkpoint intact and loadable, and
the next agents' flush succeeds and cleans up; with the trainers' memory wiped, every rank restores from its node's
first-level copy, and with one node's copy gone every rank falls back to the shared one together."""
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hpcft.agent.transport import secret as job_secret
from hpcft.agent import status as agent_status
from hpcft.agent.protection.placement import Scheme
from hpcft.agent.settings import AgentConfig
from hpcft import events
from hpcft.durable import catalog, local
from hpcft.durable.settings import PersistConfig
from hpcft.snapshot.state import ensure_optimizer_state
from multiproc import durable_job, durable_read, launch  # tests/ is on sys.path (tests/conftest.py)

JOB = "5151"
NODES = 2
DURABLE_JOB = Path(durable_job.__file__)


def _train(base: Path, out: Path, steps: int, *extra: str) -> None:
    launch.check(launch.run(4, "train", "--steps", str(steps), "--per-node", "2", *extra, root=base, out=out,
                            job_id=JOB, script=DURABLE_JOB))


def _agents(base: Path, shared: Path, persist: Path, tag: str, **persisting) -> list[subprocess.Popen]:
    settings = AgentConfig(str(shared), secret_file=str(shared / job_secret.NAME), scheme=Scheme("partner"), rounds=0,
                           interval=0.2, cpu_share=0, persist=PersistConfig(str(persist), every=1, **persisting))
    procs = []
    for i in range(NODES):
        # a node's first level: $NODE in the value is expanded by each agent (as $SLURMD_NODENAME would be under srun)
        env = {**os.environ, "HPCFT_STORE_ROOT": str(base / f"node{i}"), "HPCFT_EVENT_DIR": str(shared / "events"),
               "NODE": f"node{i}"}
        argv = [sys.executable, "-m", "hpcft.agent", "--settings", settings.to_json(), "--job-id", JOB, "--slot",
                str(i), "--slots", str(NODES), "--tag", tag]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def _wait(shared: Path, tag: str, procs: list[subprocess.Popen], ok, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = agent_status.read(shared, tag)
        if len(st) == NODES and all(ok(s) for s in st.values()):
            return
        dead = [p for p in procs if p.poll() is not None]
        assert not dead, f"an agent ended before {what}: " + dead[0].stdout.read()[-3000:]
        time.sleep(0.1)
    raise AssertionError(f"agents did not reach {what}: {agent_status.read(shared, tag)}")


def _stop(shared: Path, tag: str, procs: list[subprocess.Popen]) -> None:
    agent_status.request_stop(shared, tag)
    for p in procs:
        try:
            p.wait(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()


def _assert_loads(ckpt: Path, ref: Path) -> None:
    """Plain DCP load (one process, no hpcft) into a fresh model and optimizer equals the trained state."""
    model, opt = durable_job.model_and_optimizer()
    ensure_optimizer_state(opt)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=str(ckpt))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    want = torch.load(ref, weights_only=True)
    for name, t in model.state_dict().items():
        assert torch.equal(t, want["model"][name]), name
    got = opt.state_dict()
    for i, st in want["optim"]["state"].items():
        for k, v in st.items():
            assert torch.equal(got["state"][i][k], v), (i, k)


def _restored(base: Path, out: Path, persist: Path, nvme: Path, name: str) -> dict:
    """Wipe the trainers' memory (every node's store), restore in fresh trainers; rank 0's restored state."""
    for node in base.iterdir():
        shutil.rmtree(node)
    _train(base, out, 6, "--persist", str(persist), "--local", str(nvme), "--dump", name)
    return torch.load(out / f"{name}.pt", weights_only=True)


def _equal(got: dict, ref: Path) -> None:
    want = torch.load(ref, weights_only=True)
    for name, t in want["model"].items():
        assert durable_read.same(got["model"][name], t), name
    for i, st in want["optim"]["state"].items():
        for k, v in st.items():
            assert durable_read.same(got["optim"]["state"][i][k], v), (i, k)


@pytest.mark.slow
def test_flush_loads_with_plain_dcp_and_survives_an_agent_killed_mid_flush(tmp_path):
    base, out, shared, persist, nvme = (tmp_path / d for d in ("stores", "out", "shared", "persist", "nvme"))
    base.mkdir()
    shared.mkdir(mode=0o700)
    job_secret.create(shared)
    hold = tmp_path / "go-on"
    with ThreadPoolExecutor(1) as pool:  # one training: every rank holds after step 3 until step 3 is durable
        training = pool.submit(_train, base, out, 6, "--hold-at", "3", "--hold-file", str(hold))
        try:
            deadline = time.monotonic() + 180
            while len(list(out.glob("held.*"))) < 4 and not training.done() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert len(list(out.glob("held.*"))) == 4, training.exception(timeout=0) if training.done() else "no hold"
            procs = _agents(base, shared, persist, "a")  # no first level: straight to the persist directory
            _wait(shared, "a", procs, lambda s: s.get("persisted") == 3, "step 3 durable")
            _stop(shared, "a", procs)
        finally:
            hold.touch()
        training.result()
    assert [c.step for c in catalog.checkpoints(persist)] == [3] and not nvme.exists()
    _assert_loads(persist / "step-3", out / "ref-3.pt")

    level = {"local": str(nvme / "$NODE")}
    procs = _agents(base, shared, persist, "b", rate=20000, **level)  # a drain takes ~5 s
    _wait(shared, "b", procs, lambda s: s.get("flush_phase") == "draining", "both nodes draining")
    procs[1].send_signal(signal.SIGKILL)
    procs[0].wait(timeout=60)  # its mesh is broken: it ends too
    assert [c.step for c in catalog.checkpoints(persist)] == [3]
    assert list(persist.glob(".step-6.*.tmp")), "the killed drain left its temporary directory"
    assert [[c.step for c in local.copies(nvme / f"node{i}")] for i in range(NODES)] == [[6], [6]]
    _assert_loads(persist / "step-3", out / "ref-3.pt")

    procs = _agents(base, shared, persist, "c", **level)
    _wait(shared, "c", procs, lambda s: s.get("persisted") == 6 and s.get("local") == 6, "step 6 durable")
    _stop(shared, "c", procs)
    assert [c.step for c in catalog.checkpoints(persist)] == [3, 6]
    assert not list(persist.glob(".step-*.tmp")), "the next commit prunes the killed flush's directory"
    _assert_loads(persist / "step-6", out / "ref-6.pt")
    for i in range(NODES):  # each node's first level holds its own ranks only
        assert [c.index["ranks"] for c in local.copies(nvme / f"node{i}", persist)] == [[2 * i, 2 * i + 1]]
    evs = [e for e in events.read(shared / "events") if e.get("step") == 6]
    drained = [e["time"] for e in evs if e["event"] == "flush_local"]
    done = [e["time"] for e in evs if e["event"] == "flush_done"]
    assert len(drained) >= 2 * NODES and done and max(drained) < min(done), "committed before every node's drain"

    # the trainers' memory wiped (a site epilog): every rank reads its node's copy; then node 1's copy is gone
    _equal(_restored(base, out, persist, nvme, "from-nvme"), out / "ref-6.pt")
    src = [e for e in events.read(out) if e["event"] == "restore_source"]
    assert src[-1]["source"] == "nvme" and src[-1]["step"] == 6, src[-1]
    shutil.rmtree(nvme / "node1")
    _equal(_restored(base, out, persist, nvme, "from-pfs"), out / "ref-6.pt")
    src = [e for e in events.read(out) if e["event"] == "restore_source"]
    assert src[-1]["source"] == "durable" and src[-1]["step"] == 6 and "node-local" in src[-1]["reason"], src[-1]
    assert {e["source"] for e in events.read(out) if e["event"] == "restore_done"} >= {"nvme", "durable"}
