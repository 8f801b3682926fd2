"""`hpcft bench snapshot` (docs/results.md): the step-time cost of checkpointing every step. One trainer, its
variants interleaved in blocks (none, hpcft, torch.save, dcp.async_save, hpcft with a flushing agent); reported as
overheads over the step without checkpointing, and hpcft's copy bandwidth against a memcpy of the same bytes."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from hpcft.bench import baselines, machine
from hpcft.bench.harness import (GB, Report, Timings, local_process_group, memcpy_reference, overhead,
                                 run_interleaved, scratch, set_threads)
from hpcft.bench.model import Trainer, config_for_params
from hpcft.bench.snapshot_variants import (Checkpointing, DcpAsync, Hpcft, HpcftFlush, IdleSnapshot, NoCheckpoint,
                                          TorchSave, flush_vs_write)


@dataclass(frozen=True)
class SnapshotOptions:
    params: int = 50_000_000
    steps: int = 20
    warmup: int = 1
    block: int = 2
    threads: int = 2
    root: str | None = None
    device: str = "cpu"
    batch: int | None = None
    flush_every: int = 5  # the hpcft_flush variant's agent flushes every this many steps (0: no such variant)
    baselines: bool = True  # torch.save and dcp.async_save too (on a GPU each costs seconds a step)


def run(opts: SnapshotOptions) -> Report:
    set_threads(opts.threads)
    with scratch(opts.root) as where, local_process_group():
        trainer = Trainer(config_for_params(opts.params, opts.batch), device=opts.device)
        trainer.step()  # Adam state exists from here on, so every variant copies the same bytes
        hp = Hpcft(trainer, where.shm)
        variants = [NoCheckpoint(trainer), hp]
        if opts.baselines:
            variants += [TorchSave(trainer, where.disk), DcpAsync(trainer, where.disk)]
        flushing = HpcftFlush(trainer, where.shm, where.disk / "persist", opts.flush_every) if opts.flush_every \
            else None
        variants += [flushing] if flushing else []
        try:
            timings = run_interleaved(variants, opts.steps, opts.warmup, opts.block)
            training = hp.copy_bandwidth(first_step=hp.ckpt.store.nslots + opts.warmup + 1)  # the first measured
            idle = IdleSnapshot(hp)
            memcpy = memcpy_reference(trainer.state_bytes(), opts.device, hp.ckpt.threads)
            memcpy1 = memcpy_reference(trainer.state_bytes(), opts.device)
            memcpy1.name = "memcpy1"  # with one thread
            reference = run_interleaved([idle, memcpy, memcpy1], steps=3, warmup=1, block=1, close=True)
            stats = hp.ckpt.stats.as_dict()
            flushes = (flushing.durable(), *flush_vs_write(flushing, where.disk)) if flushing else None
        finally:
            for v in variants:
                v.close()
        r = _report(opts, trainer, timings, {v.name: v for v in variants})
        _copy_report(r, opts, hp, hp.copy_bandwidth(first_step=idle.first_step + 1), training, reference)
        r.add("snapshot_bytes", stats["last_bytes"], "B", "bytes per hpcft snapshot")
        r.add("state_bytes", trainer.state_bytes(), "B", "bytes of model + optimizer state")
        r.add("params", trainer.n_params(), "", "model parameters")
        r.add("dcp_async_form", baselines.DCP_ASYNC_FORM, "", "async_save form")
        r.note("config", {**asdict(opts), "model": asdict(trainer.cfg)})
        r.note("variants", {name: timings.summary(name) for name in timings.samples})
        if flushes is not None:
            _flush_report(r, opts, timings, *flushes)
        r.note("hpcft_stats", {k: v for k, v in stats.items() if k != "history"})
        r.note("copy_calibration", machine.calibration(hp.ckpt.copy_settings))
        return r


def _flush_report(r: Report, opts: SnapshotOptions, timings: Timings, durable: int | None, flush_bw: float,
                  write_bw: float) -> None:
    r.add("overhead_hpcft_flush", overhead(timings, "hpcft_flush", "none"), "%",
          f"hpcft every step + an agent flushing every {opts.flush_every} steps, step-time overhead")
    r.add("flush_every", opts.flush_every, "steps", "flush interval of that variant")
    r.add("flush_durable_step", durable, "", "the newest step the agent had flushed at the end (its own numbering)")
    r.add("flush_vs_write", flush_bw / write_bw, "x", "one flush's bandwidth ÷ a plain write of the same bytes to "
          "the same directory (both fsynced)")
    r.add("flush_GBps", flush_bw / GB, "GB/s", "flush bandwidth (verify, DCP records, fsync)")
    r.add("write_GBps", write_bw / GB, "GB/s", "plain sequential write + fsync")


def _report(opts: SnapshotOptions, trainer: Trainer, timings: Timings, by_name: dict[str, Checkpointing]) -> Report:
    hp, warmup = by_name["hpcft"], opts.warmup
    r = Report("snapshot")
    names = {"hpcft": "hpcft", "torch_save": "torch.save", "dcp_async": "dcp.async_save"}

    def over(k: str, cpu: bool = False) -> float | None:  # None: a baseline left out (--no-baselines)
        return overhead(timings, k, "none", cpu) if k in by_name else None

    for k, text in names.items():
        r.add(f"overhead_{k}", over(k), "%", f"{text} every step" + (", step-time overhead" if k == "hpcft" else ""))
    dcp, hpcft = over("dcp_async"), over("hpcft")
    r.add("dcp_async_vs_hpcft_overhead", dcp / hpcft if dcp is not None and hpcft > 0 else None, "x",
          "dcp.async_save overhead ÷ hpcft overhead")
    r.add("step_s_none", timings.median("none"), "s", "median step, no checkpointing")
    for k, text in names.items():
        r.add(f"cpu_overhead_{k}", over(k, cpu=True), "%", f"{text}, process CPU-time overhead")
    r.add("step_cpu_s_none", timings.cpu_median("none"), "s", "median step CPU time (all threads), no checkpointing")
    r.add("blocked_s_per_snapshot", hp.median(warmup, "blocked_s"), "s",
          "hpcft blocked per snapshot (start + pre-step wait)")
    r.add("start_s_per_snapshot", hp.median(warmup, "start_s"), "s",
          "hpcft snapshot start alone (RNG capture, state walk, manifest, copy issue)")
    r.add("inline_copy_s_per_snapshot", hp.median(warmup, "inline_copy_s"), "s",
          "hpcft copy on the training thread per snapshot (a CPU copier without overlap; 0 otherwise)")
    r.add("blocked_fraction_hpcft", hp.median(warmup, "blocked_s") / timings.median("none"), "%",
          "hpcft blocked time ÷ step (overhead without CPU contention)")
    for k, what in (("torch_save", ""), ("dcp_async", " (wait + stage)")):
        r.add(f"blocked_s_{k}", by_name[k].median(warmup) if k in by_name else None, "s",
              f"{names[k]} blocked per call{what}")
    return r


def _copy_report(r: Report, opts: SnapshotOptions, hp: Hpcft, idle: float, training: float, reference: Timings) -> None:
    """hpcft's copy+checksum bandwidth (bytes/s) with no training running (`idle`) and during training, against the
    memcpy of the same bytes with hpcft's copy threads and with one, timed in `reference`."""
    memcpy, memcpy1 = (hp.trainer.state_bytes() / reference.median(n) for n in ("memcpy", "memcpy1"))
    ref = f"{hp.ckpt.threads}-thread memcpy (hpcft's copy threads)" if opts.device == "cpu" else \
        "device→pinned host copy"
    r.add("copy_vs_memcpy", idle / memcpy, "x", f"hpcft copy+crc bandwidth ÷ {ref}")
    r.add("copy_vs_memcpy_1_thread", idle / memcpy1, "x", "the same ÷ 1-thread memcpy (earlier figures)")
    r.add("copy_vs_memcpy_in_training", training / memcpy, "x", "same, copies overlapping training")
    r.add("copy_GBps", idle / GB, "GB/s", "hpcft copy+crc bandwidth, no training running")
    r.add("copy_GBps_in_training", training / GB, "GB/s", "hpcft copy+crc bandwidth during training")
    r.add("memcpy_GBps", memcpy / GB, "GB/s", f"{ref}, same bytes")
    r.add("backend", hp.ckpt.backend, "", "hpcft copy backend")
    r.add("checksums", hp.ckpt.engine.copier.checksums, "", "where hpcft computes chunk checksums (host or device)")
    r.add("copy_threads", hp.ckpt.threads, "", "hpcft copy threads (and the reference memcpy's)")
