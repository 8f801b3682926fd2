"""A small data-parallel training job, the one run by `hpcft bench recovery` and the sandbox tests: under srun,
one task per node, a per-parameter all-reduce (bitwise reproducible, see docs/checkpointing.md), snapshots every
step with hpcft's Checkpointer and resumes from them when relaunched.

Environment (all optional but OUT):
  OUT            directory for what the job writes: progress.<rank> (last completed step), start.<rank>.<step id>
                 (the step a launch resumed from), timeline.jsonl (timestamped records, so the bench can split a
                 recovery into process start, imports, process group, model, restore and first step) and, from
                 rank 0 at the end, final.pt (parameters and the data position)
  STEPS=40 STEP_DELAY=0   steps to run, seconds of sleep after each
  WIDTH=32 LAYERS=2 DROPOUT=0.1   `LAYERS` × (Linear(WIDTH, WIDTH), Dropout, Tanh) + Linear(WIDTH, 1), AdamW
  SYNC=manual|ddp  `ddp` wraps the model in DDP (resumes equal to a few ulps only: docs/checkpointing.md)
  CKPT=hpcft|disk  `disk` is the bench's baseline: rank 0 `torch.save`s model + optimizer to OUT/ckpt.pt every
                 step (written, then renamed) and every rank resumes with `torch.load`
  HOLD_AT=S HOLD_FILE=F   the first launch waits after step S until F exists (a fault must not race the job's end)
  HANG_AT=S HANG_RANK=R   in the first launch, rank R stops making progress after step S (a hang to detect)
"""
import time

_T0 = time.time()  # before any import: the process start as the bench sees it

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402


def _record(out: Path, what: str, **fields) -> None:
    """One JSON line per event; O_APPEND keeps the ranks' lines whole."""
    tag = f"{os.environ.get('SLURM_RESTART_COUNT', '0')}.{os.environ.get('HPCFT_RESTART_COUNT', '0')}"
    line = json.dumps({"what": what, "t": time.time(), "run": tag, "pid": os.getpid(), **fields}) + "\n"
    fd = os.open(out / "timeline.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _int(name: str, default: int) -> int:
    return int(os.environ.get(name, str(default)))


def main() -> int:
    out = Path(os.environ["OUT"])
    rank_hint = int(os.environ.get("HPCFT_RANK", os.environ.get("SLURM_PROCID", "0")))
    _record(out, "start", rank=rank_hint, t=_T0)

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hpcft

    _record(out, "imported", rank=rank_hint)
    total, delay = _int("STEPS", 40), float(os.environ.get("STEP_DELAY", "0"))
    width, layers, dropout = _int("WIDTH", 32), _int("LAYERS", 2), float(os.environ.get("DROPOUT", "0.1"))
    mode = os.environ.get("CKPT", "hpcft")
    first_run = os.environ.get("HPCFT_RESTART_COUNT", "0") == "0" and os.environ.get("SLURM_RESTART_COUNT", "0") == "0"
    hold_at = _int("HOLD_AT", -1) if first_run else -1
    hold_file = Path(os.environ["HOLD_FILE"]) if os.environ.get("HOLD_FILE") else None
    hang_at = _int("HANG_AT", -1) if first_run else -1
    torch.set_num_threads(1)  # several ranks share this machine's cores
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    ctx = hpcft.init()
    _record(out, "init", rank=ctx.rank)
    body = [m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.Dropout(dropout), torch.nn.Tanh())]
    model = torch.nn.Sequential(*body, torch.nn.Linear(width, 1))  # dropout draws from the RNG hpcft must restore
    ddp = DDP(model) if os.environ.get("SYNC", "manual") == "ddp" else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seen = {"samples": 0}
    ckpt_file = out / "ckpt.pt"
    ckpt = None if mode == "disk" else hpcft.Checkpointer(model, opt, extra=lambda: dict(seen), dp_group=ctx.dp_group)
    _record(out, "built", rank=ctx.rank)
    if ckpt is None:
        start = 0
        if ckpt_file.exists():
            saved = torch.load(ckpt_file, weights_only=True)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            seen.update(saved["seen"])
            start = saved["step"] + 1
    else:
        start = ckpt.restore()
        if start:
            seen.update(ckpt.extra or {})
    _record(out, "restored", rank=ctx.rank, step=start)
    (out / f"start.{ctx.rank}.{os.environ.get('SLURM_STEP_ID', 'x')}").write_text(str(start))
    for step in range(start, total):
        g = torch.Generator().manual_seed(1000 * step + ctx.rank)
        x = torch.randn(16, width, generator=g)
        loss = torch.nn.functional.mse_loss(ddp(x), x.sum(dim=1, keepdim=True).tanh())
        opt.zero_grad()
        loss.backward()
        if ddp is model:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= ctx.world
        seen["samples"] += len(x)  # before opt.step(): the snapshot taken in its post-step hook records it
        opt.step()
        if mode == "disk" and ctx.rank == 0:
            tmp = ckpt_file.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "seen": seen}, tmp)
            os.replace(tmp, ckpt_file)
        (out / f"progress.{ctx.rank}").write_text(str(step))
        _record(out, "step", rank=ctx.rank, step=step)
        time.sleep(delay)
        if step == hold_at and hold_file is not None:
            while not hold_file.exists():
                time.sleep(0.05)
        if step == hang_at and ctx.rank == _int("HANG_RANK", 0):
            while True:  # alive, silent: only the supervisor's --hang-timeout can notice
                time.sleep(3600)
    if ckpt is not None:
        ckpt.wait()
    if ctx.rank == 0:
        torch.save({"params": {k: v.clone() for k, v in model.state_dict().items()}, "seen": seen}, out / "final.pt")
    if ckpt is not None:
        ckpt.close()
    dist.barrier()
    dist.destroy_process_group()
    _record(out, "done", rank=ctx.rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
