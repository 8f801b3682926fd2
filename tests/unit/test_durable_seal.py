"""Durable metadata that lies is refused, as the memory tier refuses an edited manifest: a durable checkpoint's
sidecars edited with every checksum of theirs recomputed (optimizer rows swapped, `lr` changed, `extra` changed, the
step relabelled) lose that checkpoint: a restore falls back to the older one (event `durable_lost` naming the file
and what differs) and `export` refuses it, in both formats. A sidecar written before the seal still loads, said."""
import json
import os
from pathlib import Path
from typing import Callable

import pytest
import torch

from hpcft import events
from hpcft.checkpointer import Checkpointer
from hpcft.durable import catalog, commit, export, flush
from hpcft.errors import HpcftError
from hpcft.options import Options
from hpcft.store import manifest as mf
from multiproc.durable_read import entries_of, flush_rank, same  # tests/ is on sys.path (tests/conftest.py)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.Linear(10, 6)).to(torch.bfloat16)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


@pytest.fixture
def saved(shm_root: Path, tmp_path: Path) -> tuple[Path, dict]:
    """Job `a` trains 4 steps (`extra` {"pos": step}) on the store root `shm_root/old`; steps 3 and 4 are flushed to
    tmp_path/persist; the state after each step."""
    persist = tmp_path / "persist"
    for d in (persist, shm_root / "old", shm_root / "new"):
        d.mkdir()
    model, opt = _model()
    pos = [0]
    refs = {}
    with Checkpointer(model, opt, Options(root=shm_root / "old", job_id="a"), extra=lambda: {"pos": pos[0]}) as ck:
        for step in (1, 2, 3, 4):
            pos[0] = step
            x = torch.randn(4, 12, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            ck.wait()
            refs[step] = entries_of(model, opt)
            if step > 2:
                flush_rank(ck.store, ck.store.versions()[-1], persist, world=1, job="a")
    return persist, refs


def _holders(d: dict) -> list[dict]:
    """Where a sidecar (or the manifest embedded in it) keeps what a restore applies: itself and its `meta`."""
    return [d] + ([d["meta"]] if isinstance(d.get("meta"), dict) else [])


def _lr(d: dict) -> None:
    for h in _holders(d):
        for g in (h.get("optim") or {}).get("param_groups") or []:
            g["lr"] = 1e9


def _extra(d: dict) -> None:
    for h in _holders(d):
        if isinstance(h.get("extra"), dict):
            h["extra"] = {"pos": 99}


def _step9(d: dict) -> None:
    if d.get("step") == 4:
        d["step"] = 9


def _rows(columns: tuple[int, ...]) -> Callable[[dict], None]:
    """Swap `columns` of the rows of the first parameter's exp_avg and exp_avg_sq (names, or where their bytes are
    with their crc32c): every row still matches the bytes it points at."""
    def swap(d: dict) -> None:
        rows = {r[commit.FQN]: r for r in d.get("items") or []}
        if not rows:  # the embedded store manifest has entries, not rows
            return
        a = next(n for n in rows if n.endswith(".exp_avg"))
        b, c = rows[a], rows[a + "_sq"]
        for i in columns:
            b[i], c[i] = c[i], b[i]
    return swap


LIES = {"rows_renamed": _rows((commit.FQN, commit.ENTRY)),
        "rows_moved": _rows((commit.DATA, commit.CRC, commit.RECORD)),
        "lr": _lr, "extra": _extra, "step": _step9}


def lie(ckpt: Path, change: Callable[[dict], None]) -> Path:
    """Apply `change` to every rank's sidecar of `ckpt` as a thorough editor would: also to the store manifest a
    sealed sidecar embeds (`snapshot`), every checksum of the metadata recomputed (the embedded manifest's, the
    sidecar's; a relabelled step: the index's and the directory's name too). The checkpoint's directory now."""
    for path in sorted(flush.sidecar_dir(ckpt).glob("rank-*.json")):
        side = json.loads(path.read_bytes())
        change(side)
        if isinstance(side.get("snapshot"), str):
            inner = mf.decode(side["snapshot"].encode())
            change(inner)
            side["snapshot"] = mf.encode(inner).decode()
        path.write_bytes(mf.encode(side, side["format"]))
    index = catalog.read_index(ckpt)
    if change is _step9:
        (flush.sidecar_dir(ckpt) / catalog.INDEX).write_bytes(mf.encode({**index, "step": 9}, catalog.CKPT_FORMAT))
        os.rename(ckpt, ckpt.with_name(catalog.final_name(9)))
        return ckpt.with_name(catalog.final_name(9))
    return ckpt


@pytest.mark.parametrize("kind", sorted(LIES))
def test_a_restore_refuses_durable_metadata_that_lies(shm_root: Path, tmp_path: Path, saved, kind: str) -> None:
    persist, refs = saved
    lied = lie(persist / "step-4", LIES[kind])
    model, opt = _model()
    with Checkpointer(model, opt,
                      Options(root=shm_root / "new", job_id="a", persist_dir=persist)) as ck:  # memory empty
        assert ck.restore() == 3 and ck.extra == {"pos": 3}  # the older, honest checkpoint
    now = entries_of(model, opt)
    assert all(same(refs[3][k], now[k]) for k in now)
    assert opt.param_groups[0]["lr"] == 1e-3
    (lost,) = [e for e in events.read(tmp_path / "events") if e["event"] == "durable_lost"]
    assert lost["path"] == str(lied) and "rank-00000.json" in lost["error"]
    (source,) = [e for e in events.read(tmp_path / "events") if e["event"] == "restore_source"]
    assert source["step"] == 3 and source["reason"].startswith(f"fell back: durable step {lied.name[5:]}")


@pytest.mark.parametrize("fmt", ["dcp", "torch"])
@pytest.mark.parametrize("kind", sorted(LIES))
def test_export_refuses_durable_metadata_that_lies(tmp_path: Path, saved, kind: str, fmt: str) -> None:
    persist, _ = saved
    lied = lie(persist / "step-4", LIES[kind])
    out = tmp_path / ("out.pt" if fmt == "torch" else "out")
    with pytest.raises(HpcftError, match="rank-00000.json"):
        export.export(persist, out, fmt, int(lied.name[5:]))
    assert not out.exists()
    assert export.export(persist, tmp_path / "honest", fmt, 3)["step"] == 3  # the older one exports


def test_the_error_names_what_differs(tmp_path: Path, saved) -> None:
    persist, _ = saved
    lie(persist / "step-4", LIES["rows_renamed"])
    with pytest.raises(HpcftError, match=r"row \d+ .*exp_avg_sq.*exp_avg"):
        export.export(persist, tmp_path / "out", "dcp", 4, check=False)  # the seal is checked even unverified
    lie(persist / "step-3", _lr)
    with pytest.raises(HpcftError, match="seal"):
        export.export(persist, tmp_path / "out", "dcp", 3)


def _unseal(ckpt: Path, fmt: str = "hpcft-durable-rank/1") -> None:
    """Rewrite `ckpt`'s sidecars as an hpcft older than the seal wrote them: `meta` (what a restore applies) beside the
    rows, no store manifest; the index as it wrote it."""
    for path in sorted(flush.sidecar_dir(ckpt).glob("rank-*.json")):
        side = json.loads(path.read_bytes())
        if isinstance(side.get("snapshot"), str):
            inner = mf.decode(side.pop("snapshot").encode())
            side.pop("pieces", None)
            side["meta"] = {k: inner.get(k) for k in ("rng", "extra", "optim", "world", "job_id", "writer", "time")}
        path.write_bytes(mf.encode(side, fmt))
    index = {k: v for k, v in catalog.read_index(ckpt).items() if k != "sealed"}
    (flush.sidecar_dir(ckpt) / catalog.INDEX).write_bytes(mf.encode(index, catalog.CKPT_FORMAT))


def test_a_checkpoint_from_before_the_seal_loads_with_a_warning(shm_root: Path, tmp_path: Path, saved) -> None:
    persist, refs = saved
    _unseal(persist / "step-4")
    model, opt = _model()
    with Checkpointer(model, opt, Options(root=shm_root / "new", job_id="a", persist_dir=persist)) as ck:
        assert ck.restore() == 4 and ck.extra == {"pos": 4}
    now = entries_of(model, opt)
    assert all(same(refs[4][k], now[k]) for k in now)
    (old,) = [e for e in events.read(tmp_path / "events") if e["event"] == "durable_unsealed"]
    assert old["level"] == "WARNING" and old["step"] == 4 and "rank-00000.json" in old["path"]
    assert export.export(persist, tmp_path / "out", "dcp", 4)["unsealed"] == 1


def test_an_unsealed_sidecar_in_a_sealed_checkpoint_is_refused(tmp_path: Path, saved) -> None:
    persist, _ = saved
    index = catalog.read_index(persist / "step-4")
    _unseal(persist / "step-4")  # the sidecars downgraded, the index still says they were sealed
    (flush.sidecar_dir(persist / "step-4") / catalog.INDEX).write_bytes(mf.encode(index, catalog.CKPT_FORMAT))
    with pytest.raises(HpcftError, match="rank-00000.json.*not sealed"):
        export.export(persist, tmp_path / "out", "dcp", 4)
