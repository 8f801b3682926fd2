"""The durable tier's node-local first level in one process: where it is (per node, $VARs expanded there), an agent's
flush through it (node-local copy published, drained, committed on the persist directory), a copy damaged on the
node-local device that the drain refuses (the previous durable checkpoint stays, event `flush_failed`), and the
restore order and its reasons with the node-local level."""
import tempfile
import time
from pathlib import Path

import pytest
import torch

from hpcft import events
from hpcft.agent.protection.bundle import complete_steps
from hpcft.agent.transport.mesh import Mesh
from hpcft.agent.protection.flush import Flusher
from hpcft.agent.protection.pins import Pins
from hpcft.checkpointer import Checkpointer
from hpcft.durable import catalog, flush, local
from hpcft.durable.resume import order, why
from hpcft.durable.settings import PersistConfig
from hpcft.options import Options
from hpcft.store.paths import job_dir


def test_local_root_is_per_node_and_defaults_under_the_nvme(tmp_path: Path) -> None:
    env = {"SLURMD_NODENAME": "frontier01234", "HPCFT_NVME": str(tmp_path / "bb")}
    assert local.local_root("/tmp/nvme/$SLURMD_NODENAME", env) == Path("/tmp/nvme/frontier01234")
    assert local.local_root(None, {**env, local.ENV_LOCAL: "/x/${SLURMD_NODENAME}/p"}) == Path("/x/frontier01234/p")
    assert local.local_root(None, env) is None  # $HPCFT_NVME not on this node
    (tmp_path / "bb").mkdir()
    assert local.local_root(None, env) == tmp_path / "bb" / local.UNDER_NVME
    assert local.local_root("none", env) is None and local.local_root(None, {}) is None


def _flush(flusher: Flusher, job: Path, timeout: float = 60) -> None:
    """The flush's collective rounds on the real mesh of a single agent (no peers), until the flush ends."""
    rendezvous = tempfile.TemporaryDirectory()
    mesh = Mesh(0, 1, b"d" * 64, rendezvous.name, host="127.0.0.1", bind="127.0.0.1", tag="flush")
    deadline = time.monotonic() + timeout
    try:
        while True:
            complete = complete_steps(job)
            flusher.round(mesh, complete, sorted(complete))
            if not flusher.busy:
                return
            assert time.monotonic() < deadline, "the flush did not end"
            time.sleep(0.02)
    finally:
        mesh.close()
        rendezvous.cleanup()


@pytest.mark.parametrize("where", ["envelope", "data"])
def test_two_level_flush_and_a_damaged_local_copy(shm_root: Path, tmp_path: Path, monkeypatch, where: str) -> None:
    persist, nvme = tmp_path / "persist", tmp_path / "nvme"
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    job = job_dir(shm_root, "j")
    woken = []  # the agent's round loop, woken when this node's part is written: the commit need not wait a round
    flusher = Flusher(PersistConfig(str(persist), every=1, keep=2, local=str(nvme)), job, "j", 0,
                      Pins("test", 30), lambda: None, lambda: woken.append(time.monotonic()))
    with Checkpointer(model, opt, Options(root=shm_root, job_id="j")) as ck:
        for it in range(2):
            model(torch.randn(4, 64)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            ck.wait()
        _flush(flusher, job)
        assert flusher.durable == 2 and flusher.local_step == 2 and flusher.last_error is None and len(woken) == 1
        assert [c.step for c in catalog.checkpoints(persist)] == [2]
        copy = local.copies(nvme, persist)[-1]
        assert copy.step == 2 and copy.index["ranks"] == [0]
        assert (persist / "step-2" / flush.data_name(0)).read_bytes() == (copy.path / flush.data_name(0)).read_bytes()
        evs = [e["event"] for e in events.read(tmp_path / "events") if e.get("step") == 2]
        assert evs.index("flush_local") < evs.index("flush_done")

        published = local.publish

        def rot(*args, **kwargs):  # the node-local device returns a flipped byte: the drain must not carry it over
            copy = published(*args, **kwargs)
            path = copy.path / flush.data_name(0)
            raw = bytearray(path.read_bytes())
            row = flush.read_sidecar(flush.sidecar_dir(copy.path) / "rank-00000.json")["items"][0]
            raw[-100 if where == "envelope" else row[6] + 3] ^= 0x10  # a torch.save suffix; a tensor's byte
            path.write_bytes(bytes(raw))
            return copy
        monkeypatch.setattr(local, "publish", rot)
        model(torch.randn(4, 64)).square().mean().backward()
        opt.step()
        ck.wait()
        _flush(flusher, job)
    assert flusher.durable == 2 and "drain" in flusher.last_error and "crc32c" in flusher.last_error
    assert len(woken) == 2  # a failed part wakes the loop too: the failure is agreed in the next round
    failed = [e for e in events.read(tmp_path / "events") if e["event"] == "flush_failed"]
    assert failed and failed[-1]["step"] == 3 and failed[-1]["level"] == "ERROR" and failed[-1]["durable"] == 2
    assert [c.step for c in catalog.checkpoints(persist)] == [2]  # the last good one stays, the damaged one unseen


def test_restore_order_and_reasons_with_the_node_local_level() -> None:
    assert order([5], [6, 4], [6, 5]) == [(6, "nvme"), (6, "durable"), (5, "memory"), (5, "nvme"), (4, "durable")]
    assert "node-local copy of step 6" in why((6, "nvme"), [5], [6, 4], [], [6, 5])
    assert "not on the shared" in why((6, "nvme"), [], [4], [], [6])
    text = why((6, "durable"), [], [6], [], [4])
    assert "no usable copy of step 6 on every node" in text and "their newest: 4" in text
    assert why((6, "durable"), [5], [6], [], None) == "the durable step is newer than memory's best 5"
