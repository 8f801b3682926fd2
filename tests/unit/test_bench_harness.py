"""The bench harness and model sizing: interleaving, drain charging, output channels, option parsing."""
import json

import click
import pytest

from hpcft.bench.cli import Count
from hpcft.bench.harness import Report, Variant, emit, run_interleaved, scratch
from hpcft.bench.model import GPT, config_for_params
from hpcft.errors import ConfigError


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Recording(Variant):
    """Each call advances the fake clock by `cost`; drain by `drain_cost`; every call is logged."""

    def __init__(self, name: str, clock: FakeClock, log: list, cost: float, drain_cost: float = 0.0) -> None:
        self.name, self.clock, self.log, self.cost, self.drain_cost = name, clock, log, cost, drain_cost

    def run_once(self, index: int) -> None:
        self.log.append((self.name, index))
        self.clock.now += self.cost

    def drain(self) -> None:
        self.clock.now += self.drain_cost


def test_interleaves_in_blocks_and_drops_warmup():
    clock, log = FakeClock(), []
    a, b = Recording("a", clock, log, 1.0), Recording("b", clock, log, 2.0)
    timings = run_interleaved([a, b], steps=3, warmup=1, block=2, clock=clock)
    assert log == [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("a", 2), ("a", 3), ("b", 2), ("b", 3)]
    assert timings.samples == {"a": [1.0, 1.0, 1.0], "b": [2.0, 2.0, 2.0]}


def test_drain_is_charged_to_the_last_call_of_a_block():
    clock, log = FakeClock(), []
    a = Recording("a", clock, log, 1.0, drain_cost=5.0)
    timings = run_interleaved([a], steps=4, warmup=0, block=2, clock=clock)
    assert timings.samples["a"] == [1.0, 6.0, 1.0, 6.0]


def test_run_interleaved_rejects_zero_steps():
    with pytest.raises(ConfigError, match="steps"):
        run_interleaved([], steps=0)


def param_count(cfg) -> int:
    """The parameters of the bench model of this shape, counted on the meta device (nothing allocated)."""
    import torch

    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg).parameters())


def test_reference_shape_for_50m():
    cfg = config_for_params(50_000_000)
    assert (cfg.layers, cfg.d_model, cfg.heads, cfg.seq, cfg.batch, cfg.vocab) == (8, 640, 10, 256, 4, 8192)
    assert param_count(cfg) == 50_039_040


def test_tiny_model_is_small():
    assert 500_000 < param_count(config_for_params(1_000_000)) < 2_000_000


@pytest.mark.parametrize("text,value", [("50M", 50_000_000), ("1e6", 1_000_000), ("1.5m", 1_500_000),
                                        ("1234", 1234), ("2k", 2000)])
def test_count_parses_suffixes(text, value):
    assert Count().convert(text, None, None) == value


def test_count_rejects_garbage():
    with pytest.raises(click.BadParameter, match="not a count"):
        Count().convert("lots", None, None)


def test_emit_json_goes_to_stdout_and_table_to_stderr(capsys):
    r = Report("demo")
    r.add("ratio", 0.5, "x", "a ratio")
    r.note("config", {"steps": 2})
    emit(r, as_json=True)
    out, err = capsys.readouterr()
    assert json.loads(out) == {"bench": "demo", "ratio": 0.5, "config": {"steps": 2}}
    assert "a ratio" in err and "0.50x" in err


def test_repeated_runs_are_judged_by_their_medians_and_a_flag_must_hold_in_every_run(capsys):
    def report(seconds: float, same: bool) -> Report:
        r = Report("demo", judge=lambda f: {"fast": f["seconds"] <= 3.0, "same": f["same"] is True})
        r.add("seconds", seconds, "s")
        r.add("same", same)
        return r

    emit([report(4.0, True), report(2.0, True), report(2.5, False)], as_json=True)
    out = json.loads(capsys.readouterr()[0])
    assert out["seconds"] == 2.5 and out["spread"]["seconds"] == [2.0, 4.0]
    assert out["same"] is False and out["met"] == {"fast": True, "same": False}
    assert out["runs"][0]["met"] == {"fast": False, "same": True}  # each run keeps its own verdict


def test_emit_table_goes_to_stdout(capsys):
    r = Report("demo")
    r.add("ratio", 0.5, "x", "a ratio")
    emit(r, as_json=False)
    out, err = capsys.readouterr()
    assert "a ratio" in out and err == ""


def test_scratch_dirs_are_removed(tmp_path):
    with scratch(tmp_path) as where:
        (where.shm / "f").write_bytes(b"x")
        (where.disk / "f").write_bytes(b"x")
        dirs = (where.shm, where.disk)
    assert not any(d.exists() for d in dirs)
    assert list(tmp_path.iterdir()) == []


def test_scratch_rejects_missing_root(tmp_path):
    with pytest.raises(ConfigError, match="--root"):
        with scratch(tmp_path / "nope"):
            pass
