"""The variants `hpcft bench snapshot` interleaves: a training step followed by no checkpoint, an hpcft snapshot,
torch.save or dcp.async_save; and an hpcft snapshot with no training."""
from __future__ import annotations

import statistics
import time
from concurrent.futures import Future
from pathlib import Path

from hpcft.bench import baselines
from hpcft.bench.harness import Variant
from hpcft.bench.model import Trainer


class Checkpointing(Variant):
    """A training step followed by one checkpoint call; the call's time (and drain's) is 'blocked'."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.per_call: dict[str, dict[int, float]] = {"blocked": {}}  # figure -> call index -> seconds
        self._last = -1

    def run_once(self, index: int) -> None:
        self.trainer.step()
        t0 = time.perf_counter()
        self.checkpoint(index)
        self.per_call["blocked"][index] = time.perf_counter() - t0
        self._last = index

    def drain(self) -> None:
        t0 = time.perf_counter()
        self.finish()
        self.per_call["blocked"][self._last] += time.perf_counter() - t0

    def checkpoint(self, index: int) -> None:
        """Take one checkpoint after the optimizer step of call `index`."""

    def finish(self) -> None:
        """Wait for background work (the next call would have waited for it)."""

    def median(self, warmup: int, figure: str = "blocked") -> float:
        """The median of a per-call figure over the measured calls (warmup excluded)."""
        return statistics.median(v for i, v in self.per_call[figure].items() if i >= warmup)


class NoCheckpoint(Checkpointing):
    name = "none"


class TorchSave(Checkpointing):
    name = "torch_save"

    def __init__(self, trainer: Trainer, directory: Path) -> None:
        super().__init__(trainer)
        self.directory = directory

    def checkpoint(self, index: int) -> None:
        baselines.torch_save(self.trainer, self.directory / f"ckpt-{index % 2}.pt")


class DcpAsync(Checkpointing):
    name = "dcp_async"

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
    """hpcft every step (`Trainer.checkpointer`: explicit steps; the pre-step hook, the guard, is installed all the
    same). Per call it also keeps the deltas of `STATS`: the training thread blocked (start + pre-step wait), the
    start alone, the copy on it."""

    STATS = ("blocked_s", "start_s", "inline_copy_s")

    name = "hpcft"

    def __init__(self, trainer: Trainer, root: Path, job_id: str = "bench") -> None:
        super().__init__(trainer)
        self.ckpt = trainer.checkpointer(root, job_id)
        self.calls = 0  # ckpt.step numbering: this variant's own iterations
        self.per_call.update({k: {} for k in self.STATS})
        self.snapshot_and_wait(self.ckpt.store.nslots)  # allocate and fault in every slot once, untimed

    def snapshot_and_wait(self, count: int) -> None:
        """Take `count` snapshots, each waited for (no training in between)."""
        for _ in range(count):
            self.ckpt.step(self.calls)
            self.calls += 1
            self.ckpt.wait()

    def run_once(self, index: int) -> None:
        before = {k: getattr(self.ckpt.stats, k) for k in self.STATS}
        super().run_once(index)
        for k, value in before.items():
            self.per_call[k][index] = getattr(self.ckpt.stats, k) - value

    def checkpoint(self, index: int) -> None:
        self.ckpt.step(self.calls)
        self.calls += 1

    def finish(self) -> None:
        before = self.ckpt.stats.blocked_s
        self.ckpt.wait()
        self.per_call["blocked_s"][self._last] += self.ckpt.stats.blocked_s - before

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

    name = "hpcft_idle"

    def __init__(self, hp: Hpcft) -> None:
        self.hp = hp
        self.first_step = hp.calls + 1

    def run_once(self, index: int) -> None:
        self.hp.snapshot_and_wait(1)
