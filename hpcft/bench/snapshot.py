"""`hpcft bench snapshot`: the step-time cost of checkpointing every step, hpcft against torch baselines.

One process trains the bench transformer with AdamW; four variants run interleaved in blocks:
no checkpointing, hpcft every step, torch.save every step, dcp.async_save every step (waiting for
each save's future before the next one, as a user must). Reported: median step time of each
variant ÷ the one without checkpointing − 1, training-thread blocked time per snapshot, and
hpcft's copy bandwidth against a single-thread memcpy of the same bytes.
"""
from __future__ import annotations

import statistics
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path

from hpcft.bench import baselines
from hpcft.bench.harness import (GB, Report, Scratch, Timings, Variant, cpu_overhead, local_process_group,
                                 memcpy_reference, overhead, run_interleaved, scratch, set_threads)
from hpcft.bench.model import Trainer, config_for_params


@dataclass(frozen=True)
class SnapshotOptions:
    """What `hpcft bench snapshot` runs: model size, measured steps per variant, warmup, block, threads,
    the device the model trains on and (optionally) its batch."""

    params: int = 50_000_000
    steps: int = 20
    warmup: int = 1
    block: int = 2
    threads: int = 2
    root: str | None = None
    device: str = "cpu"
    batch: int | None = None


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
    """hpcft every step. `auto=False` with explicit `step(it)` so that the shared trainer's steps in the
    other variants take no snapshot; the pre-step hook (the guard) is installed either way."""

    name, label = "hpcft", "hpcft every step"

    def __init__(self, trainer: Trainer, root: Path) -> None:
        from hpcft.checkpointer import Checkpointer

        super().__init__(trainer)
        self.ckpt = Checkpointer(trainer.model, trainer.optimizer, every=1, keep=2, root=str(root),
                                 job_id="bench", auto=False)
        self.calls = 0  # ckpt.step numbering: this variant's own iterations
        self.training_blocked: dict[int, float] = {}  # stats.blocked_s delta per call: start + pre-step guard
        self.training_start: dict[int, float] = {}  # stats.start_s delta per call: the start alone
        self.snapshot_and_wait(self.ckpt.store.nslots)  # allocate and fault in every slot once, untimed

    def snapshot_and_wait(self, count: int) -> None:
        """Take `count` snapshots, each waited for (no training in between)."""
        for _ in range(count):
            self.ckpt.step(self.calls)
            self.calls += 1
            self.ckpt.wait()

    def run_once(self, index: int) -> None:
        before, start = self.ckpt.stats.blocked_s, self.ckpt.stats.start_s
        super().run_once(index)
        self.training_blocked[index] = self.ckpt.stats.blocked_s - before
        self.training_start[index] = self.ckpt.stats.start_s - start

    def checkpoint(self, index: int) -> None:
        self.ckpt.step(self.calls)
        self.calls += 1

    def finish(self) -> None:
        before = self.ckpt.stats.blocked_s
        self.ckpt.wait()
        self.training_blocked[self._last] += self.ckpt.stats.blocked_s - before

    def first_measured_step(self, warmup: int) -> int:
        """The snapshot step number of this variant's first measured call."""
        return self.ckpt.store.nslots + warmup + 1

    def copy_bandwidth(self, first_step: int) -> float:
        """Median bytes/s (copy + checksum wall time) of the committed snapshots numbered >= `first_step`."""
        bw = [h["bytes"] / h["copy_s"] for h in self.ckpt.stats.history if h["step"] >= first_step and h["copy_s"]]
        return statistics.median(bw) if bw else float("nan")

    def close(self) -> None:
        self.ckpt.close()


class IdleSnapshot(Variant):
    """An hpcft snapshot and its wait with no training running: the copier's own bandwidth."""

    name, label = "hpcft_idle", "hpcft snapshot + wait, no training"

    def __init__(self, hp: Hpcft) -> None:
        self.hp = hp
        self.first_step = hp.calls + 1

    def run_once(self, index: int) -> None:
        self.hp.snapshot_and_wait(1)


def _build(opts: SnapshotOptions, where: Scratch) -> tuple[Trainer, list[Checkpointing]]:
    trainer = Trainer(config_for_params(opts.params, opts.batch), device=opts.device)
    trainer.step()  # Adam state exists from here on, so every variant copies the same bytes
    variants = [NoCheckpoint(trainer), Hpcft(trainer, where.shm), TorchSave(trainer, where.disk),
                DcpAsync(trainer, where.disk)]
    return trainer, variants


@dataclass(frozen=True)
class CopyFigures:
    """hpcft copy+checksum bandwidth with no training running and during training, and memcpy's with hpcft's copy
    threads and with one."""

    idle: float
    training: float
    memcpy: float
    snapshot_bytes: int
    memcpy1: float
    threads: int


def run(opts: SnapshotOptions) -> Report:
    """Run the snapshot bench and return its report (ratios, medians, configuration)."""
    set_threads(opts.threads)
    with scratch(opts.root) as where, local_process_group():
        trainer, variants = _build(opts, where)
        hp = next(v for v in variants if isinstance(v, Hpcft))
        try:
            timings = run_interleaved(variants, opts.steps, opts.warmup, opts.block)
            training = hp.copy_bandwidth(first_step=hp.first_measured_step(opts.warmup))
            idle = IdleSnapshot(hp)
            memcpy = memcpy_reference(trainer.state_bytes(), opts.device, hp.ckpt.threads)
            memcpy1 = memcpy_reference(trainer.state_bytes(), opts.device)
            memcpy1.name = "memcpy1"
            try:
                reference = run_interleaved([idle, memcpy, memcpy1], steps=3, warmup=1, block=1)
            finally:
                memcpy.close()
                memcpy1.close()
            stats = hp.ckpt.stats.as_dict()
        finally:
            for v in variants:
                v.close()
        copy = CopyFigures(idle=hp.copy_bandwidth(first_step=idle.first_step + 1), training=training,
                           memcpy=memcpy.nbytes / reference.median("memcpy"), snapshot_bytes=stats["last_bytes"],
                           memcpy1=memcpy1.nbytes / reference.median("memcpy1"), threads=hp.ckpt.threads)
        r = _report(opts, trainer, timings, {v.name: v for v in variants}, copy)
        r.note("hpcft_stats", {k: v for k, v in stats.items() if k != "history"})
        return r


def _report(opts: SnapshotOptions, trainer: Trainer, timings: Timings, by_name: dict[str, Checkpointing],
            copy: CopyFigures) -> Report:
    hp = by_name["hpcft"]
    measured = [v for i, v in hp.training_blocked.items() if i >= opts.warmup]
    r = Report("snapshot")
    r.add("overhead_hpcft", overhead(timings, "hpcft", "none"), "%", "hpcft every step, step-time overhead")
    r.add("overhead_torch_save", overhead(timings, "torch_save", "none"), "%", "torch.save every step")
    r.add("overhead_dcp_async", overhead(timings, "dcp_async", "none"), "%", "dcp.async_save every step")
    over = {k: r.as_dict()[f"overhead_{k}"] for k in ("hpcft", "dcp_async")}
    r.add("dcp_async_vs_hpcft_overhead", over["dcp_async"] / over["hpcft"] if over["hpcft"] > 0 else None, "x",
          "dcp.async_save overhead ÷ hpcft overhead")
    r.add("step_s_none", timings.median("none"), "s", "median step, no checkpointing")
    for k, text in (("hpcft", "hpcft"), ("torch_save", "torch.save"), ("dcp_async", "dcp.async_save")):
        r.add(f"cpu_overhead_{k}", cpu_overhead(timings, k, "none"), "%", f"{text}, process CPU-time overhead")
    r.add("step_cpu_s_none", timings.cpu_median("none"), "s", "median step CPU time (all threads), no checkpointing")
    r.add("blocked_s_per_snapshot", statistics.median(measured), "s",
          "hpcft blocked per snapshot (start + pre-step wait)")
    r.add("start_s_per_snapshot", statistics.median(v for i, v in hp.training_start.items() if i >= opts.warmup),
          "s", "hpcft snapshot start alone (state walk, manifest, copy start; a CPU copy without overlap)")
    r.add("blocked_fraction_hpcft", statistics.median(measured) / timings.median("none"), "%",
          "hpcft blocked time ÷ step (overhead without CPU contention)")
    r.add("blocked_s_torch_save", by_name["torch_save"].blocked_median(opts.warmup), "s",
          "torch.save blocked per call")
    r.add("blocked_s_dcp_async", by_name["dcp_async"].blocked_median(opts.warmup), "s",
          "dcp.async_save blocked per call (wait + stage)")
    ref = f"{copy.threads}-thread memcpy (hpcft's copy threads)" if opts.device == "cpu" else "device→pinned host copy"
    r.add("copy_vs_memcpy", copy.idle / copy.memcpy, "x", f"hpcft copy+crc bandwidth ÷ {ref}")
    r.add("copy_vs_memcpy_1_thread", copy.idle / copy.memcpy1, "x", "the same ÷ 1-thread memcpy (earlier figures)")
    r.add("copy_vs_memcpy_in_training", copy.training / copy.memcpy, "x", "same, copies overlapping training")
    r.add("copy_GBps", copy.idle / GB, "GB/s", "hpcft copy+crc bandwidth, no training running")
    r.add("copy_GBps_in_training", copy.training / GB, "GB/s", "hpcft copy+crc bandwidth during training")
    r.add("memcpy_GBps", copy.memcpy / GB, "GB/s", f"{ref}, same bytes")
    r.add("backend", hp.ckpt.backend, "", "hpcft copy backend")
    r.add("snapshot_bytes", copy.snapshot_bytes, "B", "bytes per hpcft snapshot")
    r.add("state_bytes", trainer.state_bytes(), "B", "bytes of model + optimizer state")
    r.add("params", trainer.n_params(), "", "model parameters")
    r.add("dcp_async_form", baselines.DCP_ASYNC_FORM, "", "async_save form")
    r.note("config", {**asdict(opts), "model": trainer.cfg.as_dict()})
    r.note("variants", {name: timings.summary(name) for name in timings.samples})
    return r
