"""The device checksum: crc32c assembled from pieces (hpcft.store.crcmath) equals the library's, and the Triton kernel
of hpcft.snapshot.devcrc, run by Triton's interpreter on the CPU (the same kernel code a GPU compiles), gives every
chunk the crc32c of its bytes in the slot: pieces of any length anywhere in memory, chunks cut through tensors,
host-held bytes, padding that held other bytes; through the GPU copiers' shared logic as through the kernel alone."""
import importlib.util
import os

import numpy as np
import pytest
import torch

from hpcft import events
from hpcft.snapshot import devcrc, plan
from hpcft.snapshot.copiers.base import SlotClaim, crc_chunks
from hpcft.snapshot.engine import byte_view
from hpcft.store import crc32c, crcmath, seal, seal_key

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed (make setup installs it)")


@pytest.mark.parametrize("length", [1, 3, 4, 5, 255, 4096, 70001])
def test_a_crc_assembled_from_pieces_is_the_librarys(length: int) -> None:
    data = np.random.default_rng(length).integers(0, 256, length, dtype=np.uint8)
    cut = length // 3
    raw = [crcmath.raw(part[None, :])[0] if part.size else np.uint32(0) for part in (data[:cut], data[cut:])]
    whole = crcmath.shift(np.array([raw[0]]), np.array([length - cut]))[0] ^ raw[1]
    assert int(crcmath.finish(np.array([whole]), np.array([length]))[0]) == crc32c(data)
    leading = np.concatenate([np.zeros(7, np.uint8), data])  # leading zeros leave a raw crc as it is
    assert crcmath.raw(leading[None, :])[0] == crcmath.raw(data[None, :])[0]


def test_operators_compose() -> None:
    v = np.array([0xDEADBEEF, 1, 0x80000000], dtype=np.uint32)
    assert (crcmath.apply(crcmath.zeros(1000), v) == crcmath.shift(v, np.full(3, 1000))).all()
    assert (crcmath.apply_tables(crcmath.tables(crcmath.zeros(12)), v) == crcmath.apply(crcmath.zeros(12), v)).all()
    twelve = crcmath.apply(crcmath.zeros(12), v)
    assert (crcmath.apply(crcmath.zeros(5), crcmath.apply(crcmath.zeros(7), v)) == twelve).all()
    a, b = b"scalar and", b" vectorised forms agree"
    assert crcmath.combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b) == int(crcmath.shift(
        np.array([crc32c(a)]), np.array([len(b)]))[0]) ^ crc32c(b)


@pytest.fixture
def interpreted():
    """Triton's interpreter (CPU tensors), which tests/unit/conftest.py turns on before triton is first imported."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter is off (a GPU is visible: tests/unit/test_snapshot_gpu.py runs the kernel)")


def _state() -> list[torch.Tensor]:
    """Tensors whose byte sizes are not multiples of 4 or of a piece, one of them bf16, one int8."""
    g = torch.Generator().manual_seed(3)
    return [byte_view(t) for t in (torch.randn(3, generator=g), torch.randn(700, generator=g),
                                   torch.randn(33, generator=g).to(torch.bfloat16),
                                   torch.randint(-100, 100, (1001,), dtype=torch.int8, generator=g),
                                   torch.tensor(7.0), torch.randn(64, generator=g))]


def _fill(slot: np.ndarray, sources, chunks) -> None:
    for c in chunks:
        for s in c.segments:
            slot[s.offset:s.offset + s.nbytes] = sources[s.source][s.start:s.start + s.nbytes].numpy()


@needs_triton
@pytest.mark.parametrize("lanes,words,chunk_bytes", [(16, 4, 512), (8, 2, 300), (4, 1, 4096)])
def test_the_kernel_gives_every_chunk_its_crc32c(interpreted, lanes: int, words: int, chunk_bytes: int) -> None:
    sources = _state()
    lay = plan.layout([s.numel() for s in sources], [], 0, 1)
    chunks = plan.chunks(lay.pieces, lay.nbytes, chunk_bytes)
    slot = np.full(lay.nbytes, 0xA5, dtype=np.uint8)  # another layout's bytes in the padding
    devcrc.zero_gaps(slot, chunks)
    _fill(slot, sources, chunks)
    crc = devcrc.DeviceCrc(torch.device("cpu"), lanes=lanes, words=words)
    p = crc.plan(sources, chunks, on_host={4})  # the 0-dim one plays AdamW's host-held step counter
    assert p.pieces > len(chunks)  # segments cut into several pieces, and short ones
    crc.launch(p)
    assert devcrc.finish(p, slot) == crc_chunks(slot, chunks)


@needs_triton
def test_the_production_kernel_shape(interpreted) -> None:
    """The lanes and words a GPU runs with: one whole 64 KiB piece and a short one, two chunks."""
    src = byte_view(torch.randn(20000, generator=torch.Generator().manual_seed(1)))
    lay = plan.layout([src.numel()], [], 0, 1)
    chunks = plan.chunks(lay.pieces, lay.nbytes, 70000)
    slot = np.zeros(lay.nbytes, dtype=np.uint8)
    _fill(slot, [src], chunks)
    crc = devcrc.DeviceCrc(torch.device("cpu"))
    p = crc.plan([src], chunks, on_host=set())
    crc.launch(p)
    assert devcrc.finish(p, slot) == crc_chunks(slot, chunks)


@needs_triton
def test_the_stream_copier_checksums_on_the_device(interpreted, slot) -> None:
    """The GPU copiers' shared logic with the device checksum: the chunks' crcs are the slot's, host-held bytes
    included, the gaps a reused slot held are zeroed, and no crc is left to the host's pool."""
    from test_snapshot_stream import HostStream

    sources = _state()
    lay = plan.layout([s.numel() for s in sources], [], 0, 1)
    chunks = plan.chunks(lay.pieces, lay.nbytes, 512)
    slot.array[:lay.nbytes] = 0xA5
    copier = HostStream(cap=1 << 20, host_resident=[sources[4]])
    copier.device_crc = devcrc.DeviceCrc(torch.device("cpu"), lanes=16, words=4)
    copier._crc.submit = None  # the host's pool must not be asked
    for _ in range(2):  # the second snapshot reuses the plan and finds the gaps zeroed
        transfer = copier.start(sources, chunks, SlotClaim(lambda: slot))
        copier.guard(transfer)
        assert transfer.result() == crc_chunks(slot.array, chunks)
    assert copier.checksums == "device"
    copier._crc.submit = lambda *a: pytest.fail("no host crc")
    copier.close()


@needs_triton
def test_a_kernel_that_cannot_run_hands_the_checksums_to_the_host(interpreted, slot, shm_root, monkeypatch) -> None:
    from test_snapshot_stream import HostStream

    seen = []
    monkeypatch.setattr(events, "emit", lambda kind, **f: seen.append((kind, f)))
    sources = _state()
    lay = plan.layout([s.numel() for s in sources], [], 0, 1)
    chunks = plan.chunks(lay.pieces, lay.nbytes, 512)
    copier = HostStream(cap=1 << 20)
    copier.device_crc = devcrc.DeviceCrc(torch.device("cpu"), lanes=16, words=4)
    monkeypatch.setattr(copier.device_crc, "launch", lambda p: (_ for _ in ()).throw(RuntimeError("no compiler")))
    transfer = copier.start(sources, chunks, SlotClaim(lambda: slot))
    copier.guard(transfer)
    assert transfer.result() == crc_chunks(slot.array, chunks)
    assert copier.checksums == "host" and [k for k, _ in seen] == ["device_checksum_off"]
    assert "no compiler" in seen[0][1]["error"]
    copier.close()


def test_no_device_checksum_off_a_gpu_or_when_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert devcrc.for_device(torch.device("cpu")) is None
    monkeypatch.setenv("HPCFT_DEVICE_CRC", "0")
    ok, why = devcrc.available(torch.device("cuda"))
    assert not ok and "HPCFT_DEVICE_CRC=0" in why


@pytest.mark.parametrize("on_device", [False, pytest.param(True, marks=needs_triton)])
def test_a_buffer_the_next_forward_changes_is_snapshotted_as_it_was_at_the_step(request, shm_root, on_device) -> None:
    """BatchNorm's statistics change in the forward pass, which runs while a GPU snapshot is still being copied (the
    guard holds only the optimizer's step back): the snapshot holds a buffer's value at its step, and its chunk
    checksums (the device's, taken before the copies) match the bytes that landed."""
    import threading

    from test_snapshot_stream import HostStream

    from hpcft.snapshot.engine import SnapshotEngine
    from hpcft.snapshot.state import Entry
    from hpcft.store import RankStore

    if on_device:
        request.getfixturevalue("interpreted")
    weight, stats = torch.randn(300), torch.zeros(50)
    entries = [Entry("model/w", weight, False), Entry("model/bn.running_mean", stats, False, boundary=True)]
    busy = threading.Event()
    copier = HostStream(cap=1 << 20, device_busy=busy)
    if on_device:
        copier.device_crc = devcrc.DeviceCrc(torch.device("cpu"), lanes=16, words=4)
    engine = SnapshotEngine(RankStore("j", 0, root=shm_root), copier, chunk_bytes=512)
    assert engine.snapshot(1, entries, {})
    stats.add_(1.0)  # the next forward pass, while the copy has not run yet
    busy.set()
    engine.wait()
    version = engine.store.versions()[-1]
    data = engine.store.slot(version.slot).array
    saved = {e["name"]: torch.from_numpy(data[e["offset"]:e["offset"] + e["nbytes"]].copy()).view(torch.float32)
             for e in version.manifest["entries"]}
    assert torch.equal(saved["model/bn.running_mean"], torch.zeros(50))
    assert torch.equal(saved["model/w"], weight)
    key = seal_key(version.manifest)
    assert all(seal(crc32c(data[o:o + n]), key) == c for o, n, c in version.manifest["chunks"])
    engine.close()


def test_doctor_says_where_checksums_are_computed() -> None:
    from hpcft.doctor import _checksums

    check = _checksums()
    assert check.ok and check.name == "snapshot checksums"
    assert ("on the GPU" in check.detail) == (torch.cuda.is_available() and devcrc.available(torch.device("cuda"))[0])


@needs_triton
def test_the_kernel_is_compiled_before_the_first_snapshot(interpreted, slot, monkeypatch) -> None:
    """`copiers.make` has the issuing thread compile the kernel at once; a kernel that cannot be built turns the device
    checksum off there, with its event, before any snapshot."""
    from test_snapshot_stream import HostStream

    launched, seen = [], []
    copier = HostStream(cap=1 << 20)
    copier.device_crc = devcrc.DeviceCrc(torch.device("cpu"), lanes=16, words=4)
    real = copier.device_crc.launch
    monkeypatch.setattr(copier.device_crc, "launch", lambda p: launched.append(p.pieces) or real(p))
    copier.warm_up()
    copier._issuer.submit(lambda: None).result()
    assert launched == [1] and copier.checksums == "device"
    copier.close()

    monkeypatch.setattr(events, "emit", lambda kind, **f: seen.append(kind))
    broken = HostStream(cap=1 << 20)
    broken.device_crc = devcrc.DeviceCrc(torch.device("cpu"), lanes=16, words=4)
    monkeypatch.setattr(broken.device_crc, "launch", lambda p: (_ for _ in ()).throw(RuntimeError("no compiler")))
    broken.warm_up()
    broken._issuer.submit(lambda: None).result()
    assert broken.checksums == "host" and seen == ["device_checksum_off"]
    broken.close()
