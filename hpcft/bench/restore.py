"""`hpcft bench restore` (docs/results.md): the state after one AdamW step, saved once by hpcft (shm store), DCP
and torch.save (local disk), restored interleaved by each into a perturbed live model and optimizer, every restore
checked bit for bit (untimed); reported against a memcpy of the same bytes and as speedups over DCP and torch.load."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hpcft.bench import baselines, machine
from hpcft.bench.harness import (GB, Report, StoreMemcpy, Timings, Variant, local_process_group, memcpy_reference,
                                 run_interleaved, scratch, set_threads)
from hpcft.bench.model import Trainer, config_for_params
from hpcft.errors import CheckpointError
from hpcft.store import hugepages
from hpcft.store.paths import DATA, slot_file


@dataclass(frozen=True)
class RestoreOptions:
    """What `hpcft bench restore` runs: model size, measured restores per path, warmup, threads, store root, device."""

    params: int = 50_000_000
    repeats: int = 5
    warmup: int = 1
    threads: int = 2
    root: str | None = None
    device: str = "cpu"  # where the live model is: a restore from the host store into device memory on a GPU


class Restoring(Variant):
    """Path `name`: `load(trainer)` brings `reference` back into `trainer`; perturbed before and verified bitwise after
    each call."""

    def __init__(self, name: str, trainer: Trainer, reference: list[torch.Tensor],
                 load: Callable[[Trainer], object] | None = None) -> None:
        self.name, self.trainer, self.reference, self.load = name, trainer, reference, load

    def run_once(self, index: int) -> None:
        self.load(self.trainer)

    def prepare(self, index: int) -> None:
        with torch.no_grad():
            for t in self.trainer.state_tensors():
                if t.is_floating_point() and t.numel() > 1:
                    t.view(-1)[0] += 1.0

    def drain(self) -> None:
        """A restore into a GPU ends when its last copy has landed: waited for inside the timed call."""
        if self.trainer.device.type != "cpu":
            torch.cuda.synchronize(self.trainer.device)

    def check(self, index: int) -> None:
        live = self.trainer.state_tensors()
        if len(live) != len(self.reference) or not all(torch.equal(a, b) for a, b in zip(live, self.reference)):
            raise CheckpointError(f"bench restore: {self.name} did not bring back the saved state bit for bit")


class HpcftColdRestore(Restoring):
    """What a relaunched process does: open the store (map the slot), then restore; the Checkpointer is made and its
    restore timed together, its close is not. `prefetched`: a relaunch whose `hpcft.init` mapped the newest slot
    ahead (hpcft.store.prefetch) while the ranks met: the prefetch runs untimed before each call, as it overlaps the
    process group's rendezvous; its own time is kept (`prefetch_s`)."""

    def __init__(self, trainer: Trainer, reference: list[torch.Tensor], root: Path, prefetched: bool = False) -> None:
        super().__init__("hpcft_prefetched" if prefetched else "hpcft_cold", trainer, reference)
        self.root, self.prefetched, self.ckpt, self.prefetch_s = root, prefetched, None, []

    def prepare(self, index: int) -> None:
        from hpcft.store import prefetch

        super().prepare(index)
        if self.prefetched:
            t0 = time.perf_counter()
            thread = prefetch.ahead("bench", 0, self.root, threads=prefetch.threads())  # as hpcft.init does
            if thread is None:
                raise CheckpointError(f"bench restore: no slot to map ahead under {self.root}")
            thread.join()
            self.prefetch_s.append(time.perf_counter() - t0)

    def run_once(self, index: int) -> None:
        self.ckpt = self.trainer.checkpointer(self.root)
        self.ckpt.restore()

    def check(self, index: int) -> None:
        self.ckpt.close()
        super().check(index)


def _trained(opts: RestoreOptions) -> Trainer:
    trainer = Trainer(config_for_params(opts.params), device=opts.device)
    trainer.step()  # creates the Adam moments, so the restored state is the full training state
    return trainer


def run(opts: RestoreOptions) -> Report:
    set_threads(opts.threads)
    with scratch(opts.root) as where, local_process_group():
        source = _trained(opts)
        ckpt = source.checkpointer(where.shm)
        try:
            ckpt.step(0)  # iteration 0 done: the state after one optimizer step
            ckpt.wait()
            baselines.torch_save(source, where.disk / "ckpt.pt")
            baselines.dcp_save(source, where.disk / "dcp")
            reference = [t.clone() for t in source.state_tensors()]
            state_bytes = source.state_bytes()
            prefetched = HpcftColdRestore(_trained(opts), reference, where.shm, prefetched=True)
            threads = ckpt.copy_settings.restore.threads
            variants = [Restoring("hpcft", source, reference, lambda t: ckpt.restore()),
                        HpcftColdRestore(_trained(opts), reference, where.shm), prefetched,
                        Restoring("dcp_load", _trained(opts), reference,
                                  lambda t: baselines.dcp_load(t, where.disk / "dcp")),
                        Restoring("torch_load", _trained(opts), reference,
                                  lambda t: baselines.torch_load(t, where.disk / "ckpt.pt")),
                        # as many threads as the restore on a CPU; pinned host -> device on a GPU
                        memcpy_reference(state_bytes, opts.device, threads, to_device=True)]
            if opts.device == "cpu":  # the same copy out of the store's own file, mapped once and mapped anew
                [newest] = ckpt.store.versions()[-1:]
                data = slot_file(ckpt.store.dir, newest.slot, DATA)
                variants += [StoreMemcpy(data, newest.manifest["data_bytes"], threads, fresh)
                             for fresh in (False, True)]
            timings = run_interleaved(variants, opts.repeats, opts.warmup, block=1, close=True)
        finally:
            ckpt.close()
        r = _report(opts, source, timings, state_bytes)
        r.add("prefetch_s", statistics.median(prefetched.prefetch_s[opts.warmup:] or prefetched.prefetch_s), "s",
              "mapping the slot ahead (in a relaunch: hidden by the init it overlaps), median")
        r.add("restore_threads", threads, "", "hpcft restore threads (and the memcpy's)")
        r.note("copy_calibration", machine.calibration(ckpt.copy_settings))
        r.note("store_pages", hugepages.mode(where.shm))  # what the cold restore's page faults cost depends on
        return r


def _report(opts: RestoreOptions, trainer: Trainer, timings: Timings, state_bytes: int) -> Report:
    hp, dcp, tl, mc, cold, pre = (timings.median(n) for n in ("hpcft", "dcp_load", "torch_load", "memcpy", "hpcft_cold",
                                                              "hpcft_prefetched"))
    r = Report("restore")
    r.add("restore_vs_memcpy", mc / hp, "x", "hpcft restore bandwidth ÷ memcpy with as many threads")
    if "memcpy_shm" in timings.samples:
        shm, fresh = timings.median("memcpy_shm"), timings.median("memcpy_shm_fresh")
        r.add("restore_vs_memcpy_shm", shm / hp, "x", "the same against memcpy out of the store file's own mapping")
        r.add("restore_vs_memcpy_shm_cold", fresh / cold, "x", "a relaunch's against memcpy out of a fresh mapping "
              "of it")
        r.add("memcpy_shm_s", shm, "s", "memcpy out of the store's mapping into torch memory, median")
        r.add("memcpy_shm_fresh_s", fresh, "s", "the same out of a fresh mapping (mapped in the timed call), median")
    r.add("speedup_vs_dcp", dcp / hp, "x", "hpcft restore speedup over dcp.load")
    r.add("speedup_vs_torch_load", tl / hp, "x", "hpcft restore speedup over torch.load")
    r.add("restore_vs_memcpy_cold", mc / cold, "x", "the same for a relaunch: open the store (map the slot) + restore")
    r.add("speedup_vs_dcp_cold", dcp / cold, "x", "a relaunch's open + restore against dcp.load")
    r.add("restore_vs_memcpy_prefetched", mc / pre, "x", "the same with the slot mapped ahead during init (prefetch)")
    r.add("restore_GBps", state_bytes / hp / GB, "GB/s", "hpcft restore bandwidth")
    r.add("memcpy_GBps", state_bytes / mc / GB, "GB/s", "memcpy with hpcft's threads (on a GPU: pinned host→device), "
          "same bytes (interleaved)")
    r.add("restore_s_hpcft", hp, "s", "hpcft restore, median")
    r.add("restore_s_hpcft_cold", cold, "s", "hpcft open the store + restore, median")
    r.add("restore_s_hpcft_prefetched", pre, "s", "hpcft open the store + restore after the prefetch, median")
    r.add("restore_s_dcp", dcp, "s", "dcp.load + set_state_dict, median")
    r.add("restore_s_torch_load", tl, "s", "torch.load + load_state_dict, median")
    r.add("state_bytes", state_bytes, "B", "bytes restored")
    r.add("params", trainer.n_params(), "", "model parameters")
    r.add("verified", True, "", "every restore bitwise equal to the saved state")
    r.note("config", {**asdict(opts), "model": asdict(trainer.cfg)})
    r.note("variants", {name: timings.summary(name) for name in timings.samples})
    return r
