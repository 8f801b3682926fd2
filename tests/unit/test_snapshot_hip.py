"""The hip backend's own code (hipMemcpyAsync, hipHostRegister, HIP events and stream) on every CI run,
against the fake runtime of fake_hip.py: snapshots land bit-exact, every event, stream and registration
it creates is destroyed (none accumulates over 100 snapshots), and every HIP error code is raised as a
CheckpointError naming the call, on success and failure paths alike."""
import sys
import types
from pathlib import Path

import pytest
import torch

from fake_hip import FakeHip, hipError_t
from hpcft.checkpointer import Checkpointer
from hpcft.errors import CheckpointError
from hpcft.options import Options
from hpcft.snapshot import copiers, plan
from hpcft.snapshot.copiers.base import crc_chunks
from hpcft.snapshot.copiers.base import SlotClaim
from hpcft.snapshot.copiers.hip import HipCopier
from hpcft.snapshot.state import collect


class OnFakeDevice(HipCopier):
    """The hip copier as on a GPU: CPU tensors play device memory, except 0-dim ones (AdamW keeps the step
    counters of GPU parameters on the host); torch's current stream is HIP's null stream."""

    def _on_host(self, t: torch.Tensor) -> bool:
        return t.dim() == 0

    def _compute_stream(self) -> int:
        return 0


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeHip:
    """`from hip import hip` yields the fake runtime."""
    runtime = FakeHip()
    monkeypatch.setitem(sys.modules, "hip", types.SimpleNamespace(hip=runtime))
    monkeypatch.setitem(sys.modules, "hip.hip", runtime)
    return runtime


def _hip_checkpointer(monkeypatch: pytest.MonkeyPatch, net, opt, root: Path) -> Checkpointer:
    monkeypatch.setattr(copiers, "choose", lambda backend, device: "hip")
    monkeypatch.setattr(copiers, "make", lambda backend, device, **kw: OnFakeDevice(
        device, kw.get("max_inflight_bytes", 64 << 10), kw.get("threads", 2)))
    # small chunks and cap: many events per snapshot, and the cap makes the issuer land events mid-issue
    return Checkpointer(net, opt,
                        Options(root=root, job_id="hip", keep=2, chunk_bytes=4096, max_inflight_bytes=64 << 10))


def _model(seed: int):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64))
    return net, torch.optim.AdamW(net.parameters(), lr=1e-2)


def _state(net, opt) -> dict[str, torch.Tensor]:
    return {e.name: e.local.clone() for e in collect(net, opt, None)}


@pytest.mark.slow
def test_hundred_snapshots_leave_no_event_stream_or_registration(fake: FakeHip, shm_root: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    net, opt = _model(0)
    live_events = []
    with _hip_checkpointer(monkeypatch, net, opt, shm_root) as ckpt:
        assert ckpt.backend == "hip"
        for it in range(100):
            net(torch.randn(8, 64)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            live_events.append(fake.live()["event"])
        ckpt.wait()
        assert ckpt.engine.stats.snapshots == 100 and ckpt.engine.stats.failed == 0
        assert fake.live()["event"] == 0  # between snapshots nothing is held but the stream and the slots' pins
        assert fake.live()["stream"] == 1 and fake.live()["registration"] <= 3  # keep=2: three slots
        want = _state(net, opt)
    assert fake.live() == {"event": 0, "stream": 0, "registration": 0}
    assert fake.created == fake.destroyed
    per_snapshot = fake.created["event"] / 100
    assert per_snapshot > 10 and fake.peak_events <= per_snapshot + 2  # one snapshot's worth at most
    assert max(live_events[50:]) <= max(live_events[:50])  # nothing accumulates
    assert fake.calls["hipMemcpyAsync"] >= 100 * 4

    net2, opt2 = _model(1)
    with _hip_checkpointer(monkeypatch, net2, opt2, shm_root) as again:
        assert again.restore() == 100
        got = _state(net2, opt2)
    assert want.keys() == got.keys() and [k for k in want if not torch.equal(want[k], got[k])] == []


def _attempt(sources, chunks, slot) -> list[CheckpointError]:
    """Construct, snapshot once, close, as the engine does, collecting the errors each stage raises."""
    errors: list[CheckpointError] = []

    def run(f, *args):
        try:
            return f(*args)
        except CheckpointError as exc:
            errors.append(exc)

    copier = run(OnFakeDevice, torch.device("cpu"), 16 << 10)
    if copier is not None:
        transfer = run(copier.start, sources, chunks, SlotClaim(lambda: slot))
        if transfer is not None:
            run(copier.guard, transfer)
            if run(transfer.result) is not None:
                assert transfer.result() == crc_chunks(slot.array, chunks)
        run(copier.close)
    return errors


def _work():
    sources = [torch.randint(0, 255, (5000,), dtype=torch.uint8) for _ in range(12)]
    lay = plan.layout([5000] * 12, [], 0, 1)
    return sources, plan.chunks(lay.pieces, lay.nbytes, 4096)


# what the runtime still holds after a failed call of that kind: the thing it refused to destroy
LEFT = {"hipEventDestroy": "event", "hipHostUnregister": "registration", "hipStreamDestroy": "stream"}


@pytest.mark.parametrize("call", ["hipSetDevice", "hipStreamCreateWithFlags", "hipHostRegister",
                                  "hipEventCreateWithFlags", "hipEventRecord", "hipStreamWaitEvent",
                                  "hipMemcpyAsync", "hipEventSynchronize", "hipEventDestroy",
                                  "hipHostUnregister", "hipStreamDestroy"])
def test_every_hip_error_is_raised_naming_the_call(fake: FakeHip, slot, call: str) -> None:
    sources, chunks = _work()
    assert _attempt(sources, chunks, slot) == []  # the good path first
    assert fake.live() == {"event": 0, "stream": 0, "registration": 0}
    fake.fail[call] = hipError_t.hipErrorInvalidValue
    errors = _attempt(sources, chunks, slot)
    assert errors, f"a failing {call} went unnoticed"
    assert str(errors[0]) == f"HIP call {call} failed on cpu: hipErrorInvalidValue (code 1)"
    assert call not in fake.fail  # the failure was the call's, not a later one's
    expected = {"event": 0, "stream": 0, "registration": 0}
    if call in LEFT:
        expected[LEFT[call]] = 1
    assert fake.live() == expected  # failure paths release what they made too
