"""Training scenarios run as real ranks by launch.py (one process per rank, gloo, CPU).

  roundtrip --kind ddp|tp|fsdp[,...]   snapshot, clobber, restore into a fresh model+optimizer: bitwise equal?
                                 (several kinds: one after the other in the same ranks, each in its own job's store)
  damaged                        3 snapshots; rank 1 alone damages two (a FIFO for step 3's data file, a lying
                                 manifest for step 2): every rank must restore step 1, bit for bit, none hang
  train --steps N [--kill-at K] [--delay S] [--tag T]
                                 train with snapshots every step; SIGKILL itself right after step K
                                 (mid-snapshot with --delay); restore on start; save reference states

  --backend B          the default group's backend for hpcft.init() (e.g. `cuda:gloo`: like NCCL/RCCL, it
                       refuses CPU tensors); DDP then syncs gradients on a gloo group of its own (the device traffic)
  --user-groups        the script makes its own groups, as torchtitan or Megatron do: init_process_group(B) and
                       a data-parallel new_group of every rank, no hpcft.init()
"""
import argparse
import json
import os
import random
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

import hpcft
from hpcft.snapshot import state as hstate

D = 16


def carries_cpu(pg) -> bool:
    return "cpu:" in dist.get_backend_config(pg)


def build(kind: str, ctx, dropout: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(D, 4 * D), torch.nn.ReLU(), torch.nn.Linear(4 * D, D),
                                torch.nn.Dropout(dropout))
    model.register_buffer("seen", torch.zeros(3))
    if kind == "ddp":  # gradients on a CPU group here, where a GPU job's would travel on its NCCL group
        pg = None if carries_cpu(dist.group.WORLD) else dist.new_group(backend="gloo")
        return torch.nn.parallel.DistributedDataParallel(model, process_group=pg)
    if kind == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        return parallelize_module(model, ctx.mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=ctx.mesh["dp"])
        return fully_shard(model, mesh=ctx.mesh["dp"])
    raise SystemExit(f"unknown kind {kind}")


def batch(it: int, dp_rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * it + dp_rank)
    return torch.randn(8, D, generator=g)


def train_step(kind: str, ctx, model, opt, it: int, pos: dict) -> None:
    x = batch(it, ctx.dp_rank)
    pos["pos"] = it + 1  # batches consumed: what extra() reports at the optimizer step
    loss = model(x).pow(2).mean() + 0.01 * torch.rand(()).item()  # draws from the torch RNG too
    loss.backward()
    if kind == "tp" and ctx.dp > 1:  # data parallel by hand across the dp dimension
        for p in model.parameters():
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            dist.all_reduce(g, group=ctx.dp_group)
            g.div_(ctx.dp)
    with torch.no_grad():
        model.get_buffer("module.seen" if kind == "ddp" else "seen").add_(1)
    random.random(), np.random.rand()  # RNG draws belong before the step: auto snapshots capture RNG there
    opt.step()
    opt.zero_grad()


def snapshot_of(model, opt) -> dict[str, torch.Tensor]:
    return {e.name: e.local.clone() for e in hstate.collect(model, opt, None)}


def rng_now() -> dict:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, st, gauss = random.getstate()
    return {"torch": torch.get_rng_state().clone(), "python": [version, list(st), gauss],
            "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached]}


def same_rng(a: dict, b: dict) -> bool:
    return (torch.equal(a["torch"], b["torch"]) and a["python"] == b["python"] and a["numpy"][0] == b["numpy"][0]
            and torch.equal(a["numpy"][1], b["numpy"][1]) and a["numpy"][2:] == b["numpy"][2:])


def diff(ref: dict, now: dict) -> list[str]:
    bad = [k for k in ref if k not in now or ref[k].dtype != now[k].dtype or not torch.equal(ref[k], now[k])]
    return bad + [k for k in now if k not in ref]


def roundtrip(args, ctx) -> dict:
    kinds = args.kind.split(",")
    reports = {kind: roundtrip_one(kind, args.steps, ctx, f"{os.environ['HPCFT_JOB_ID']}-{kind}") for kind in kinds}
    return {"ok": all(r["ok"] for r in reports.values()), "kinds": reports}


def roundtrip_one(kind: str, steps: int, ctx, job: str) -> dict:
    model = build(kind, ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    pos = {"pos": 0}
    ckpt = hpcft.Checkpointer(model, opt, hpcft.Options(chunk_bytes=1024, job_id=job), extra=lambda: dict(pos),
                              dp_group=ctx.dp_group)
    if ckpt.restore() != 0:
        return {"ok": False, "why": "fresh run did not restore 0"}
    for it in range(steps):
        train_step(kind, ctx, model, opt, it, pos)
    ckpt.wait()
    ref, ref_rng = snapshot_of(model, opt), rng_now()
    stats = ckpt.stats.as_dict()
    ckpt.close()
    # a fresh model and optimizer (other seed, no optimizer state), as after a relaunch
    torch.manual_seed(123), random.seed(5), np.random.seed(5)
    model2 = build(kind, ctx)
    with torch.no_grad():
        for p in model2.parameters():
            p.add_(1.0)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5, weight_decay=0.1)
    ckpt2 = hpcft.Checkpointer(model2, opt2, hpcft.Options(job_id=job), dp_group=ctx.dp_group)
    step = ckpt2.restore()
    now = snapshot_of(model2, opt2)
    bad = diff(ref, now)
    ok = step == steps and not bad and same_rng(ref_rng, rng_now()) and ckpt2.extra == {"pos": steps} \
        and opt2.param_groups[0]["lr"] == 1e-2
    ckpt2.close()
    return {"ok": ok, "step": step, "mismatch": bad, "extra": ckpt2.extra, "entries": len(ref),
            "bytes_copied": stats["bytes"], "rng_equal": same_rng(ref_rng, rng_now())}


def _damage(store_dir: Path) -> None:
    """Rank 1's own damage: step 3's data file becomes a FIFO, step 2's manifest lies about an offset (its own
    checksum recomputed)."""
    from hpcft.store import manifest

    by_step = {json.loads(p.read_bytes())["step"]: p for p in store_dir.glob("slot-*.json")}
    data = by_step[3].with_suffix(".data")
    data.unlink()
    os.mkfifo(data, 0o600)
    m = json.loads(by_step[2].read_bytes())
    m["entries"][0]["offset"] += 64
    by_step[2].write_bytes(manifest.encode(m))


def damaged(args, ctx) -> dict:
    model = build("ddp", ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    pos, refs = {"pos": 0}, {}
    with hpcft.Checkpointer(model, opt, hpcft.Options(chunk_bytes=1024, keep=3), extra=lambda: dict(pos),
                            dp_group=ctx.dp_group) as ckpt:
        for it in range(3):
            train_step("ddp", ctx, model, opt, it, pos)
            ckpt.wait()
            refs[it + 1] = (snapshot_of(model, opt), rng_now())
        store_dir = ckpt.store.dir
    if ctx.rank == 1:
        _damage(store_dir)
    dist.barrier()
    torch.manual_seed(123)
    model2 = build("ddp", ctx)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5, weight_decay=0.1)
    with hpcft.Checkpointer(model2, opt2, dp_group=ctx.dp_group) as again:
        start = again.restore()
        bad = diff(refs[1][0], snapshot_of(model2, opt2))
        ok = start == 1 and not bad and same_rng(refs[1][1], rng_now()) and again.extra == {"pos": 1}
    return {"ok": ok, "start": start, "mismatch": bad}


def train(args, ctx) -> dict:
    torch.use_deterministic_algorithms(True)
    model = build("ddp", ctx, dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    pos = {"pos": 0}
    ckpt = hpcft.Checkpointer(model, opt, hpcft.Options(chunk_bytes=1024, overlap=True), extra=lambda: dict(pos),
                              dp_group=ctx.dp_group)
    ckpt.engine.copier._delay_per_chunk = args.delay  # the test seam: a slow copy, in flight when a rank is killed
    torch.manual_seed(7 + ctx.rank), random.seed(7), np.random.seed(7)  # the run's seed; restore overrides it
    start = ckpt.restore()
    out = Path(args.out)
    report = {"start": start, "extra": ckpt.extra}
    ref = out / f"ref-rank{ctx.rank}-step{start}.pt"
    if start and ref.exists():
        saved = torch.load(ref)
        report["restored_equal"] = not diff(saved["state"], snapshot_of(model, opt)) and same_rng(saved["rng"], rng_now())
    pos["pos"] = start
    for it in range(start, args.steps):
        train_step("ddp", ctx, model, opt, it, pos)
        if args.kill_at == it + 1:
            os.kill(os.getpid(), signal.SIGKILL)  # the snapshot of this step is in flight
        if args.save_refs:
            ckpt.wait()
            torch.save({"state": snapshot_of(model, opt), "rng": rng_now()}, out / f"ref-rank{ctx.rank}-step{it + 1}.pt")
    ckpt.wait()
    torch.save({k: v for k, v in model.state_dict().items()}, out / f"final-{args.tag}-rank{ctx.rank}.pt")
    ckpt.close()
    return {**report, "ok": True}


def user_groups(backend: str) -> SimpleNamespace:
    """What a script that makes its own groups hands hpcft: its default group and a data-parallel group."""
    rank, world = int(os.environ["HPCFT_RANK"]), int(os.environ["HPCFT_WORLD_SIZE"])
    dist.init_process_group(backend, init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                            rank=rank, world_size=world)
    return SimpleNamespace(rank=rank, world=world, dp=world, dp_rank=rank, dp_group=dist.new_group(list(range(world))),
                           close=dist.destroy_process_group)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario")
    ap.add_argument("--out", required=True)
    ap.add_argument("--kind", default="ddp")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--kill-at", type=int, default=0)
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--tag", default="run")
    ap.add_argument("--save-refs", action="store_true")
    ap.add_argument("--backend", default=None)
    ap.add_argument("--user-groups", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ctx = user_groups(args.backend) if args.user_groups else hpcft.init(tp=args.tp, backend=args.backend)
    fn = {"roundtrip": roundtrip, "train": train, "damaged": damaged}[args.scenario]
    report = fn(args, ctx)
    Path(args.out, f"{args.scenario}-{args.tag}-rank{ctx.rank}.json").write_text(json.dumps(report, default=str))
    dist.barrier(group=None if carries_cpu(dist.group.WORLD) else dist.new_group(backend="gloo"))
    ctx.close()
    return 0 if report.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
