"""`hpcft bench snapshot`: the step-time cost of checkpointing every step, hpcft against torch baselines.

One process trains the bench transformer with AdamW; four variants run interleaved in blocks:
no checkpointing, hpcft every step, torch.save every step, dcp.async_save every step (waiting for
each save's future before the next one, as a user must). Reported: median step time of each
variant ÷ the one without checkpointing − 1, training-thread blocked time per snapshot, and
hpcft's copy bandwidth against a single-thread memcpy of the same bytes.
"""
from __future__ import annotations

import logging
import statistics
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path

from hpcft.bench import baselines
from hpcft.bench.harness import (GB, Report, Scratch, Timings, Variant, local_process_group, memcpy_bandwidth,
                                 overhead, run_interleaved, scratch, set_threads)
from hpcft.bench.model import Trainer, config_for_params

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SnapshotOptions:
    """What `hpcft bench snapshot` runs: model size, measured steps per variant, warmup, block, threads."""

    params: int = 50_000_000
    steps: int = 8
    warmup: int = 1
    block: int = 2
    threads: int = 2
    root: str | None = None


class Checkpointing(Variant):
    """A training step followed by one checkpoint call; the call's time (and drain's) is 'blocked'."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.blocked: dict[int, float] = {}
        self._last = -1

    def run_once(self, index: int) -> None:
        self.trainer.step()
        t0 = time.perf_counter()
        self.checkpoint(index)
        self.blocked[index] = time.perf_counter() - t0
        self._last = index

    def drain(self) -> None:
        t0 = time.perf_counter()
        self.finish()
        self.blocked[self._last] = self.blocked.get(self._last, 0.0) + time.perf_counter() - t0

    def checkpoint(self, index: int) -> None:
        """Take one checkpoint after the optimizer step of call `index`."""

    def finish(self) -> None:
        """Wait for background work (the next call would have waited for it)."""

    def blocked_median(self, warmup: int) -> float:
        return statistics.median(v for i, v in self.blocked.items() if i >= warmup)


class NoCheckpoint(Checkpointing):
    name, label = "none", "no checkpointing"


class TorchSave(Checkpointing):
    name, label = "torch_save", "torch.save every step"

    def __init__(self, trainer: Trainer, directory: Path) -> None:
        super().__init__(trainer)
        self.directory = directory

    def checkpoint(self, index: int) -> None:
        baselines.torch_save(self.trainer, self.directory / f"ckpt-{index % 2}.pt")


class DcpAsync(Checkpointing):
    name, label = "dcp_async", "dcp.async_save every step"

    def __init__(self, trainer: Trainer, directory: Path) -> None:
        import torch.distributed as dist

        super().__init__(trainer)
        self.directory = directory
        self.group = dist.new_group(backend="gloo")
        self.future: Future | None = None

    def checkpoint(self, index: int) -> None:
        self.finish()
        self.future = baselines.dcp_async_save(self.trainer, self.directory / f"dcp-{index % 2}", self.group)

    def finish(self) -> None:
        if self.future is not None:
            self.future.result()
            self.future = None


class Hpcft(Checkpointing):
    name, label = "hpcft", "hpcft every step"

    def __init__(self, trainer: Trainer, root: Path) -> None:
        from hpcft.checkpointer import Checkpointer

        super().__init__(trainer)
        self.ckpt = Checkpointer(trainer.model, trainer.optimizer, every=1, keep=2, root=str(root),
                                 job_id="bench")

    def checkpoint(self, index: int) -> None:
        self.ckpt.step(index)

    def finish(self) -> None:
        self.ckpt.wait()

    def close(self) -> None:
        self.ckpt.close()


def _build(opts: SnapshotOptions, where: Scratch) -> tuple[Trainer, list[Checkpointing]]:
    trainer = Trainer(config_for_params(opts.params))
    trainer.step()  # Adam state exists from here on, so every variant copies the same bytes
    variants = [NoCheckpoint(trainer), Hpcft(trainer, where.shm), TorchSave(trainer, where.disk),
                DcpAsync(trainer, where.disk)]
    return trainer, variants


def run(opts: SnapshotOptions) -> Report:
    """Run the snapshot bench and return its report (ratios, medians, configuration)."""
    set_threads(opts.threads)
    with scratch(opts.root) as where, local_process_group():
        trainer, variants = _build(opts, where)
        try:
            timings = run_interleaved(variants, opts.steps, opts.warmup, opts.block)
        finally:
            for v in variants:
                v.close()
        state_bytes = trainer.state_bytes()
        memcpy = memcpy_bandwidth(state_bytes)
        by_name = {v.name: v for v in variants}
        return _report(opts, trainer, timings, by_name, state_bytes, memcpy)


def _report(opts: SnapshotOptions, trainer: Trainer, timings: Timings, by_name: dict[str, Checkpointing],
            state_bytes: int, memcpy: float) -> Report:
    hp = by_name["hpcft"]
    stats = _hpcft_stats(hp, opts.warmup)
    r = Report("snapshot")
    r.add("overhead_hpcft", overhead(timings, "hpcft", "none"), "%", "hpcft every step, step-time overhead")
    r.add("overhead_torch_save", overhead(timings, "torch_save", "none"), "%", "torch.save every step")
    r.add("overhead_dcp_async", overhead(timings, "dcp_async", "none"), "%", "dcp.async_save every step")
    r.add("blocked_s_per_snapshot", stats["blocked_s"], "s", "hpcft blocked per snapshot (training thread)")
    r.add("copy_vs_memcpy", stats["copy_Bps"] / memcpy, "x", "hpcft copy bandwidth ÷ 1-thread memcpy")
    r.add("copy_GBps", stats["copy_Bps"] / GB, "GB/s", "hpcft copy bandwidth")
    r.add("memcpy_GBps", memcpy / GB, "GB/s", "memcpy, 1 thread, same bytes")
    r.add("step_s_none", timings.median("none"), "s", "median step, no checkpointing")
    r.add("blocked_s_torch_save", by_name["torch_save"].blocked_median(opts.warmup), "s",
          "torch.save blocked per call")
    r.add("blocked_s_dcp_async", by_name["dcp_async"].blocked_median(opts.warmup), "s",
          "dcp.async_save blocked per call (wait + stage)")
    hp_over, dcp_over = r.as_dict()["overhead_hpcft"], r.as_dict()["overhead_dcp_async"]
    r.add("dcp_async_vs_hpcft_overhead", dcp_over / hp_over if hp_over > 0 else None, "x",
          "dcp.async_save overhead ÷ hpcft overhead")
    r.add("snapshot_bytes", state_bytes, "B", "bytes per snapshot")
    r.add("params", trainer.n_params(), "", "model parameters")
    r.add("dcp_async_form", baselines.DCP_ASYNC_FORM, "", "async_save form")
    r.note("config", {**asdict(opts), "model": trainer.cfg.as_dict()})
    r.note("variants", {name: timings.summary(name) for name in timings.samples})
    r.note("hpcft_stats", stats)
    return r


def _hpcft_stats(hp: Hpcft, warmup: int) -> dict[str, float]:
    """Blocked seconds and copy bandwidth of hpcft's measured snapshots, from the Checkpointer's stats."""
    return {"blocked_s": hp.blocked_median(warmup), "copy_Bps": float("nan")}
