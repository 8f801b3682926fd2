"""hpcft's durable reader in one process: box tiling, the restore order (pure), a restore from the durable tier when
memory holds nothing or only older steps, a chunk failing its crc32c (fall back to the older checkpoint), and
`hpcft export` (DCP tree, refusal of a non-empty target, one consolidated torch.save file)."""
from pathlib import Path

import pytest
import torch

from hpcft import events
from hpcft.checkpointer import Checkpointer
from hpcft.cli import main
from hpcft.durable import boxes, catalog, commit, export
from hpcft.durable.boxes import Box
from hpcft.durable.resume import order
from hpcft.options import Options
from multiproc.durable_read import entries_of, flush_rank, same  # tests/ is on sys.path (tests/conftest.py)


def test_overlap_and_tiling() -> None:
    want = Box((2, 3), (4, 5))  # rows 2..5, columns 3..7
    assert boxes.overlap(want, Box((0, 0), (3, 4))) == Box((2, 3), (1, 1))
    assert boxes.overlap(want, Box((6, 0), (2, 9))) is None  # touches, does not overlap
    assert boxes.overlap(Box((), ()), Box((), ())) == Box((), ())  # a 0-dim tensor
    # a data-parallel share: a partial row, whole rows, a partial row (in element order)
    rows = [("a", Box((0, 0), (1, 10))), ("b", Box((1, 0), (1, 6))), ("c", Box((1, 6), (1, 4))),
            ("d", Box((2, 0), (4, 10))), ("e", Box((6, 0), (1, 10)))]
    got = boxes.parts(want, rows)
    assert [p.row for p in got] == ["d"] and got[0].src == (slice(0, 4), slice(3, 8)) and \
        got[0].dst == (slice(0, 4), slice(0, 5))
    split = [("x", Box((0, 0), (4, 6))), ("y", Box((0, 6), (8, 4))), ("z", Box((4, 0), (4, 6)))]
    parts = boxes.parts(want, split)
    assert sum(p.box.volume for p in parts) == want.volume and {p.row for p in parts} == {"x", "y", "z"}
    assert boxes.parts(want, split[:2]) is None  # a hole: not covered
    assert boxes.parts(want, split + [("dup", Box((0, 0), (4, 6)))]) is None  # two ranks' own copies
    # tiers: own rows fall short, the group's tile it, anyone's is never read
    read = []

    def tiers():
        for name, tier in (("own", split[:1]), ("group", split), ("any", rows)):
            read.append(name)
            yield tier
    assert boxes.select(want, tiers())[0] == 1 and read == ["own", "group"]
    assert boxes.select(Box((0,), (0,)), [[]]) == (0, [])  # an empty shard takes nothing


def test_restore_order_is_newest_first_memory_first_at_a_tie() -> None:
    assert order([5, 4], [6, 4, 2]) == [(6, "durable"), (5, "memory"), (4, "memory"), (4, "durable"),
                                        (2, "durable")]
    assert order([], [3]) == [(3, "durable")] and order([], []) == []


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.Linear(10, 6)).to(torch.bfloat16)
    model.register_buffer("seen", torch.arange(5, dtype=torch.float32))  # mixed dtypes (and AdamW's fp32 steps)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _train(model, opt, steps: int, start: int = 0) -> None:
    for it in range(start, steps):
        x = torch.randn(4, 12, generator=torch.Generator().manual_seed(it)).to(torch.bfloat16)
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()


@pytest.fixture
def saved(shm_root: Path, tmp_path: Path) -> tuple[Path, dict]:
    """Job `a` trains 3 steps; steps 2 and 3 are flushed to tmp_path/persist; the state after each step."""
    persist = tmp_path / "persist"
    persist.mkdir()
    model, opt = _model()
    refs = {}
    with Checkpointer(model, opt, Options(root=shm_root, job_id="a"), extra=lambda: {"pos": 7}) as ck:
        for step in (1, 2, 3):
            _train(model, opt, step, step - 1)
            ck.wait()
            refs[step] = (entries_of(model, opt), torch.get_rng_state())
            if step > 1:
                flush_rank(ck.store, ck.store.versions()[-1], persist, world=1, job="a")
    return persist, refs


def _kinds(tmp_path: Path) -> list[str]:
    return [e["event"] for e in events.read(tmp_path / "events")]


def test_the_durable_tier_wins_when_memory_holds_only_an_older_step(shm_root: Path, tmp_path: Path, saved) -> None:
    persist, refs = saved
    model, opt = _model()
    with Checkpointer(model, opt, Options(root=shm_root, job_id="b", persist_dir=persist)) as ck:
        _train(model, opt, 1)  # job b's memory holds step 1: older than the durable tier's 3
        ck.wait()
    torch.manual_seed(99)
    with Checkpointer(model, opt, Options(root=shm_root, job_id="b", persist_dir=persist)) as ck:
        assert ck.restore() == 3 and ck.extra == {"pos": 7}
    now = entries_of(model, opt)
    assert now.keys() == refs[3][0].keys() and all(same(refs[3][0][k], now[k]) for k in now)
    assert torch.equal(torch.get_rng_state(), refs[3][1])
    (source,) = [e for e in events.read(tmp_path / "events") if e["event"] == "restore_source"]
    assert source["source"] == "durable" and source["step"] == 3 and "newer than memory's best 1" in source["reason"]


def test_memory_wins_at_an_equal_step(shm_root: Path, tmp_path: Path, saved) -> None:
    persist, refs = saved  # job a's memory holds steps 2 and 3, its durable tier 2 and 3
    model, opt = _model()
    with Checkpointer(model, opt, Options(root=shm_root, job_id="a", persist_dir=persist)) as ck:
        assert ck.restore() == 3
    now = entries_of(model, opt)
    assert all(same(refs[3][0][k], now[k]) for k in now)
    (source,) = [e for e in events.read(tmp_path / "events") if e["event"] == "restore_source"]
    assert source["source"] == "memory" and source["reason"].endswith("(durable newest 3)")


def test_a_chunk_failing_its_crc_falls_back_to_the_older_checkpoint(shm_root: Path, tmp_path: Path, saved) -> None:
    persist, refs = saved
    newest = catalog.newest(persist)
    side = commit.sidecars(newest.path, 1)[0]
    row = side["items"][len(side["items"]) // 2]
    with open(newest.path / side["file"], "r+b") as fh:  # flip one byte of a chunk's raw data
        fh.seek(row[commit.DATA])
        b = fh.read(1)
        fh.seek(row[commit.DATA])
        fh.write(bytes([b[0] ^ 0x40]))
    model, opt = _model()
    with Checkpointer(model, opt, Options(root=shm_root, job_id="c", persist_dir=persist)) as ck:
        assert ck.restore() == 2
    now = entries_of(model, opt)
    assert all(same(refs[2][0][k], now[k]) for k in now)
    kinds = _kinds(tmp_path)
    assert {"durable_chunk_lost", "durable_lost", "restore_fallback"} <= set(kinds)
    (source,) = [e for e in events.read(tmp_path / "events") if e["event"] == "restore_source"]
    assert source["step"] == 2 and source["reason"].startswith("fell back: durable step 3")
    with pytest.raises(Exception, match="crc32c"):  # an export verifies what it links
        export.export(persist, tmp_path / "out", step=3)


def test_export_dcp_and_torch(tmp_path: Path, saved, capsys) -> None:
    persist, refs = saved
    out = tmp_path / "dcp"
    assert main(["export", "--from", str(persist), "--to", str(out), "--step", "2"]) == 0
    assert catalog.read_index(out)["step"] == 2 and (out / ".metadata").is_file()
    again = main(["export", "--from", str(persist), "--to", str(out)])  # never over a non-empty directory
    assert again == 1 and "is not an empty directory" in capsys.readouterr().err
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _model()
    _train(model, opt, 1)
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(out))  # plain DCP, no process group
    for k, v in msd.items():
        assert same(refs[2][0][f"model/{k}"], v), k
    single = tmp_path / "full.pt"
    assert main(["export", "--from", str(persist), "--to", str(single), "--format", "torch"]) == 0
    full = torch.load(single, weights_only=True)
    for k, v in refs[3][0].items():
        kind, _, rest = k.partition("/")
        got = full["model"][rest] if kind == "model" else full["optim"]["state"][rest.rsplit("/", 1)[0]][
            rest.rsplit("/", 1)[1]]
        assert same(v, got), k
    assert full["optim"]["param_groups"][0]["lr"] == 1e-3 and full["optim"]["param_groups"][0]["params"] == \
        ["0.weight", "0.bias", "1.weight", "1.bias"]
