"""The durable tier's writer side on one process: the boxes of a run of elements, crc32c combination, torch.save
envelopes, a flushed snapshot that plain dcp.load reads bit for bit, and the commit's refusals (a damaged store
chunk, a missing rank, a step already durable)."""
import io
import math
import os
import random
import struct
import zlib

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import hpcft
from hpcft.durable import catalog, commit, envelope, files, flush, items
from hpcft.errors import IntegrityError, StoreError
from hpcft.snapshot.state import ensure_optimizer_state
from hpcft.store import crc32c, crcmath

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_boxes_cover_a_run_of_elements_in_order() -> None:
    rng = random.Random(1)
    for _ in range(400):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        n = math.prod(shape)
        a = rng.randint(0, n)
        b = rng.randint(a, n)
        t = torch.arange(n).reshape(shape)
        seen = []
        for off, size, first in items.boxes(shape, a, b):
            vals = t[tuple(slice(o, o + s) for o, s in zip(off, size))].reshape(-1).tolist()
            assert vals == list(range(first, first + len(vals)))
            seen += vals
        assert seen == list(range(a, b)), (shape, a, b)
        assert len(items.boxes(shape, a, b)) <= 2 * len(shape) - 1


def test_crc_combine_equals_the_crc_of_the_concatenation() -> None:
    rng = random.Random(2)
    for _ in range(100):
        a, b = os.urandom(rng.randint(0, 5000)), os.urandom(rng.randint(0, 5000))
        assert crcmath.combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)


@pytest.mark.parametrize("dtype", sorted(envelope.STORAGE))
def test_envelope_is_torch_saves_own_and_loads(dtype) -> None:
    """hpcft builds the record around a tensor's bytes without torch: byte for byte what torch.save writes under
    skip_data (but the random serialization id), and torch.load reads it with the bytes put in place."""
    for shape in [(), (3,), (3, 4), (2, 3, 5), (300, 233), (1, 2, 3, 4), (0,), (5, 0, 2), (3, 70000)]:
        prefix, suffix = envelope.envelope(dtype, shape)
        theirs, their_suffix = envelope._torch_envelope(dtype, shape)
        # torch's random serialization id (the last record's 40 digits), and its crc32 twice, made ours
        digits = _their_id(their_suffix)
        their_suffix = their_suffix.replace(digits, envelope._SERIAL_ID).replace(
            struct.pack("<I", zlib.crc32(digits)), struct.pack("<I", zlib.crc32(envelope._SERIAL_ID)))
        assert (prefix, suffix) == (theirs, their_suffix), shape
        x = (torch.randn(shape) * 100).to(getattr(torch, dtype))
        y = torch.load(io.BytesIO(prefix + x.reshape(-1).view(torch.uint8).numpy().tobytes() + suffix),
                       weights_only=True)
        assert y.dtype == x.dtype and y.shape == x.shape and y.stride() == x.stride() and torch.equal(y, x), shape


def _their_id(suffix: bytes) -> bytes:
    """The 40-digit serialization id torch.save wrote: the data of the record named .data/serialization_id."""
    at = suffix.index(b"archive/.data/serialization_id") + len(b"archive/.data/serialization_id")
    pad = struct.unpack("<H", suffix[at + 2:at + 4])[0]
    return suffix[at + 4 + pad:at + 4 + pad + 40]


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 3)).to(torch.bfloat16)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


@pytest.fixture
def snapshot(tmp_path):
    """A real snapshot of 3 AdamW steps of a bf16 model: (checkpointer, its newest version, data)."""
    model, opt = _model()
    ckpt = hpcft.Checkpointer(model, opt, hpcft.Options(root=tmp_path, job_id="w", chunk_bytes=256))
    for _ in range(3):
        model(torch.randn(2, 8, dtype=torch.bfloat16)).float().sum().backward()
        opt.step()
        opt.zero_grad()
    ckpt.wait()
    v = ckpt.store.versions()[-1]
    yield ckpt, v, ckpt.store.slot(v.slot, create=False).array
    ckpt.close()


def _tmp(persist, step: int, flush_id: str = "w-1"):
    tmp = files.make_dir(persist / catalog.tmp_name(step, flush_id))
    files.make_dir(flush.sidecar_dir(tmp))
    return tmp


def test_a_flushed_snapshot_loads_with_plain_dcp_bit_for_bit(snapshot, tmp_path) -> None:
    ckpt, v, data = snapshot
    persist = tmp_path / "persist"
    flush.write_rank(v.manifest, data, _tmp(persist, v.step))
    done = commit.commit(persist / catalog.tmp_name(v.step, "w-1"), persist, v.step, 1, "w", 2)
    assert [c.step for c in catalog.checkpoints(persist)] == [v.step] and done.path == persist / f"step-{v.step}"
    model, opt = _model()
    ensure_optimizer_state(opt)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=str(done.path))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    for (name, want), got in zip(ckpt.model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(want, got), name
    for p, q in zip(ckpt.model.parameters(), model.parameters()):
        for k, t in ckpt.optimizer.state[p].items():
            assert torch.equal(t, opt.state[q][k]), k
    assert opt.param_groups[0]["lr"] == 1e-3


def test_a_damaged_store_chunk_is_never_flushed(snapshot, tmp_path) -> None:
    _, v, data = snapshot
    bad = data.copy()
    bad[300] ^= 1
    tmp = _tmp(tmp_path, v.step)
    with pytest.raises(IntegrityError, match="fails its crc32c"):
        flush.write_rank(v.manifest, bad, tmp)
    assert not list(flush.sidecar_dir(tmp).iterdir())
    with pytest.raises(StoreError, match="no sidecar of rank 0"):
        commit.commit(tmp, tmp_path, v.step, 1, "w", 2)
    assert catalog.checkpoints(tmp_path) == []


def test_a_durable_step_is_never_replaced_and_old_ones_are_pruned(snapshot, tmp_path) -> None:
    _, v, data = snapshot
    persist = tmp_path / "persist"
    flush.write_rank(v.manifest, data, _tmp(persist, v.step, "w-1"))
    first = commit.commit(persist / catalog.tmp_name(v.step, "w-1"), persist, v.step, 1, "w", 1)
    before = (first.path / ".metadata").read_bytes()
    flush.write_rank(v.manifest, data, _tmp(persist, v.step, "w-2"))
    again = commit.commit(persist / catalog.tmp_name(v.step, "w-2"), persist, v.step, 1, "w", 1)
    assert again.path == first.path and (first.path / ".metadata").read_bytes() == before
    assert not list(persist.glob(".step-*.tmp"))
