"""The variants `hpcft bench snapshot` interleaves: a training step followed by no checkpoint, an hpcft snapshot,
torch.save, dcp.async_save, or an hpcft snapshot while a node agent flushes to the durable tier; an hpcft snapshot
with no training; and one flush against a plain write of the same bytes (`flush_vs_write`)."""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path

from hpcft.agent import status as agent_status
from hpcft.agent.protection.placement import Scheme
from hpcft.agent.settings import AgentConfig
from hpcft.agent.transport import secret as job_secret
from hpcft.bench import baselines
from hpcft.bench.harness import Variant
from hpcft.bench.model import Trainer
from hpcft.durable import files, flush
from hpcft.durable.settings import PersistConfig
from hpcft.errors import HpcftError
from hpcft.store import job_dir, secure_dir
from hpcft.store import pin as store_pin

FLUSH_JOB = "bench-flush"


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
            self.checkpoint(0)
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


class HpcftFlush(Hpcft):
    """hpcft every step into its own store, and a node agent (one slot, no protection) flushing the newest snapshot
    to `persist` every `every` steps while training goes on. A block ends once a flush in progress has finished:
    the wait counts as blocked (conservative: a real run would overlap it with its next steps)."""

    name = "hpcft_flush"

    def __init__(self, trainer, root: Path, persist: Path, every: int) -> None:
        store_pin.announce(secure_dir(job_dir(root, FLUSH_JOB)))  # the store keeps a slot free for the agent's pin
        self.shared = Path(tempfile.mkdtemp(prefix="agents-", dir=root))
        job_secret.create(self.shared)
        env = {**os.environ, "HPCFT_STORE_ROOT": str(root), "HPCFT_EVENT_DIR": str(self.shared)}
        settings = AgentConfig(str(self.shared), secret_file=str(self.shared / job_secret.NAME), scheme=Scheme("none"),
                               rounds=0, interval=0.1, cpu_share=0, persist=PersistConfig(str(persist), every=every))
        argv = [sys.executable, "-m", "hpcft.agent", "--settings", settings.to_json(), "--job-id", FLUSH_JOB,
                "--slot", "0", "--slots", "1"]
        self.agent = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        super().__init__(trainer, root, job_id=FLUSH_JOB)

    def finish(self) -> None:
        super().finish()
        t0 = time.perf_counter()
        while any(s.get("flushing") for s in agent_status.read(self.shared, "0").values()):
            if self.agent.poll() is not None:
                raise HpcftError(f"the bench's agent ended: {self.agent.stderr.read()[-2000:]}")
            time.sleep(0.01)
        self.per_call["blocked_s"][self._last] += time.perf_counter() - t0

    def durable(self) -> int | None:
        return (agent_status.read(self.shared, "0").get(0) or {}).get("persisted")

    def close(self) -> None:
        agent_status.request_stop(self.shared, "0")
        try:
            self.agent.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.agent.kill()
        super().close()


def flush_vs_write(hp: Hpcft, directory: Path, repeats: int = 3) -> tuple[float, float]:
    """(flush bytes/s, plain write bytes/s): the newest snapshot of `hp` written by `flush.write_rank` (verified,
    as DCP records, fsynced) and the same number of bytes written from the same memory as one file (fsynced),
    interleaved, medians of `repeats`."""
    version = hp.ckpt.store.versions()[-1]
    data = hp.ckpt.store.slot(version.slot, create=False).array[:version.manifest["data_bytes"]]
    flush_s, write_s, nbytes = [], [], 0
    for i in range(repeats):
        ckpt = files.make_dir(directory / f"flush-{i}")
        files.make_dir(flush.sidecar_dir(ckpt))
        t0 = time.perf_counter()
        nbytes = flush.write_rank(version.manifest, data, ckpt)["file_bytes"]
        flush_s.append(time.perf_counter() - t0)
        path = directory / f"plain-{i}"
        t0 = time.perf_counter()
        fd = files.create(path)
        files.write_all(fd, data, path)
        files.finish(fd, path)
        write_s.append(time.perf_counter() - t0)
    return nbytes / statistics.median(flush_s), data.size / statistics.median(write_s)
