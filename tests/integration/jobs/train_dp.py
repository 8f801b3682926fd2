"""A small data-parallel training job for the sandbox tests: run under srun, one task per node.

Writes progress (last completed step) to $OUT/progress.<rank> and, at the end, rank 0 writes the
final parameters to $OUT/final.pt. Resumes from hpcft's in-memory snapshots when relaunched.
"""
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hpcft


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 32, generator=g)
    return x, x.sum(dim=1, keepdim=True).tanh()


def main() -> int:
    out = Path(os.environ["OUT"])
    total = int(os.environ.get("STEPS", "40"))
    delay = float(os.environ.get("STEP_DELAY", "0"))
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    ctx = hpcft.init()
    dropout = float(os.environ.get("DROPOUT", "0.1"))  # draws from the RNG that hpcft must restore
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Dropout(dropout), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    # SYNC=ddp wraps the model in DDP. DDP's first iteration after construction reduces gradients in a
    # way that differs from its later iterations in the last bits (seen with plain load_state_dict too,
    # without hpcft), so a resumed DDP run is equal only to a few ulps; docs/checkpointing.md. The
    # default is a plain per-parameter all-reduce, which resumes bit for bit.
    ddp = DDP(model) if os.environ.get("SYNC", "manual") == "ddp" else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seen = {"samples": 0}
    ckpt = hpcft.Checkpointer(model, opt, extra=lambda: dict(seen), dp_group=ctx.dp_group)
    start = ckpt.restore()
    if start:
        seen.update(ckpt.extra or {})
    (out / f"start.{ctx.rank}.{os.environ.get('SLURM_STEP_ID', 'x')}").write_text(str(start))
    for step in range(start, total):
        x, y = batch(step, ctx.rank)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        if ddp is model:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= ctx.world
        seen["samples"] += len(x)  # before opt.step(): the snapshot taken in its post-step hook records it
        opt.step()
        (out / f"progress.{ctx.rank}").write_text(str(step))
        time.sleep(delay)
    ckpt.wait()
    if ctx.rank == 0:
        torch.save({"params": {k: v.clone() for k, v in model.state_dict().items()}, "seen": seen}, out / "final.pt")
    ckpt.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
