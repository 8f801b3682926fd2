"""Restore against manifests that pass their own checksum but lie, versions found corrupt, and the messages a
person reads: every lie is `manifest_bad` and a fallback to the older version, bit for bit, never a load of the
wrong bytes and never a raw KeyError/TypeError; a version fallen back past is never picked again."""
import json
from pathlib import Path
from typing import Callable

import pytest
import torch

from hpcft import events
from hpcft.checkpointer import Checkpointer
from hpcft.errors import CheckpointError
from hpcft.options import Options
from hpcft.store import manifest

from live_state import same, state_of  # tests/unit is on sys.path (pytest's rootdir insertion)


def _model(seed: int = 0, swapped: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
    if swapped:  # the same tensors, registered in another order
        model = torch.nn.Sequential()
        model.add_module("2", torch.nn.Linear(16, 8))
        model.add_module("0", torch.nn.Linear(8, 16))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _step(model, opt, it: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(it))
    model(x).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def _train(root: Path, steps: range, refs: dict) -> None:
    model, opt = _model()
    with Checkpointer(model, opt, Options(root=root, job_id="j", chunk_bytes=256), extra=lambda: {"n": len(refs)}) as c:
        if steps.start:
            assert c.restore() == steps.start
        for it in steps:
            _step(model, opt, it)
            refs[it + 1] = state_of(model, opt)
        c.wait()


def _restore(root: Path) -> tuple[int, dict]:
    model, opt = _model(9)
    with Checkpointer(model, opt, Options(root=root, job_id="j", chunk_bytes=256)) as c:
        return c.restore(), state_of(model, opt)


def _newest(root: Path) -> Path:
    rdir = next(root.glob("hpcft-*-j")) / "rank-00000"
    return max(rdir.glob("slot-*.json"), key=lambda p: json.loads(p.read_bytes())["step"])


def _edit(path: Path, change: Callable[[dict], None]) -> None:
    """Change a committed manifest and recompute its own checksum, as a person with an editor and the source would."""
    m = json.loads(path.read_bytes())
    change(m)
    path.write_bytes(manifest.encode(m))


def _kinds(tmp: Path) -> list[str]:
    return [e["event"] for e in events.read(tmp / "events")]


def _shift_offset(m: dict) -> None:
    m["entries"][2]["offset"] += 64  # still inside the file, every chunk's crc32c still right


def _swap_entries(m: dict) -> None:
    e = m["entries"]
    e[0]["offset"], e[2]["offset"] = e[2]["offset"], e[0]["offset"]
    e[0]["name"], e[2]["name"] = e[2]["name"], e[0]["name"]


LIES = {
    "offset shifted": _shift_offset,
    "names swapped with their offsets": _swap_entries,
    "step moved ahead": lambda m: m.update(step=7),
    "step as a string": lambda m: m.update(step="2"),
    "data_bytes as a string": lambda m: m.update(data_bytes=str(m["data_bytes"])),
    "chunk table as an object": lambda m: m.update(chunks={"0": m["chunks"][0]}),
    "chunk row too short": lambda m: m["chunks"].__setitem__(0, m["chunks"][0][:2]),
    "entries missing": lambda m: m.pop("entries"),
    "shape with a string": lambda m: m["entries"][0].update(shape=["16", 8]),
    "another rank's": lambda m: m.update(rank=1),
    "another slot's": lambda m: m.update(slot=m["slot"] + 1),
    "rng as a string": lambda m: m.update(rng="x"),
    "rng torch state cut": lambda m: m["rng"].update(torch=m["rng"]["torch"][:40]),
    "python rng with a float": lambda m: m["rng"]["python"][1].__setitem__(3, 0.5),
    "lr as a string": lambda m: m["optim"]["param_groups"][0].update(lr="fast"),
    "betas of one": lambda m: m["optim"]["param_groups"][0].update(betas={"tuple": [0.9]}),
    "extra changed": lambda m: m.update(extra={"n": 99}),
    "extra as a list": lambda m: m.update(extra=[1]),
}


@pytest.mark.parametrize("lie", list(LIES))
def test_a_manifest_that_lies_is_manifest_bad_and_falls_back(shm_root: Path, tmp_path: Path, lie: str) -> None:
    refs: dict = {}
    _train(shm_root, range(2), refs)
    _edit(_newest(shm_root), LIES[lie])
    step, got = _restore(shm_root)
    assert step == 1 and same(got, refs[1])  # never step 2's bytes read at a lie's offsets, never a raw error
    assert {"manifest_bad", "restore_fallback"} & set(_kinds(tmp_path))  # refused when read, or when loaded


def test_a_version_fallen_back_past_is_never_picked_again(shm_root: Path, tmp_path: Path) -> None:
    refs: dict = {}
    _train(shm_root, range(3), refs)  # steps 1, 2, 3
    bad = _newest(shm_root)
    data = bad.with_suffix(".data")
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0x40
    data.write_bytes(raw)  # step 3 is corrupt
    resumed: dict = {}
    _train(shm_root, range(2, 3), resumed)  # restores step 2, writes a new step 3
    step, got = _restore(shm_root)
    assert step == 3 and same(got, resumed[3])  # the new step 3, not the corrupt one nor step 2
    withdrawn = [e for e in events.read(tmp_path / "events") if e["event"] == "version_withdrawn"]
    assert [e["step"] for e in withdrawn] == [3]


def test_a_mismatch_names_saved_and_live_and_the_first_difference(shm_root: Path) -> None:
    refs: dict = {}
    _train(shm_root, range(1), refs)
    model, opt = _model(swapped=True)
    with Checkpointer(model, opt, Options(root=shm_root, job_id="j")) as c:
        with pytest.raises(CheckpointError) as info:
            c.restore()
    text = str(info.value)
    assert "entry 0 is saved as model/0.weight float32 [16, 8] but live as model/2.weight float32 [8, 16]" in text
    assert "order differs: the live state has model/0.weight at entry 2" in text
    assert "step 1: step 1" not in text and text.count("step 1") == 1


def test_restore_done_counts_the_versions_it_skipped(shm_root: Path, tmp_path: Path) -> None:
    refs: dict = {}
    _train(shm_root, range(3), refs)
    _newest(shm_root).write_bytes(b"{torn")  # step 3: unreadable, never a candidate
    assert _restore(shm_root)[0] == 2
    (done,) = [e for e in events.read(tmp_path / "events") if e["event"] == "restore_done"]
    assert done["skipped"] == 1 and done["fallbacks"] == 0
