"""Fully sharded data parallel (FSDP2, torch.distributed.fsdp.fully_shard), made fault-tolerant with hpcft: every
parameter, gradient and AdamW moment is sharded across the ranks, each block gathered for its forward and backward.

  python examples/fsdp2.py                                  # a laptop: one process, CPU
  hpcft run --spares 1 -- python examples/fsdp2.py          # inside a Slurm allocation, one rank per task
  sbatch examples/frontier/fsdp2.sbatch                     # Frontier (see examples/README.md)

hpcft snapshots each rank's shards (its own, nothing to split) and restores them bit for bit at the same world size;
FSDP2 reduce-scatters the gradients the same way at every step, so a resumed run equals an uninterrupted one.
"""
import sys

import torch
from torch.distributed.fsdp import fully_shard

import common
import hpcft


def main() -> int:
    args = common.parser(__doc__).parse_args()

    ctx = hpcft.init()                                  # rank, world, device and process groups from the launcher
    common.setup(args, ctx)
    model = common.TinyGPT(args).to(ctx.device)
    for block in model.blocks:                          # one all-gather per block, then the rest (embeddings, head)
        fully_shard(block, mesh=ctx.mesh["dp"])
    fully_shard(model, mesh=ctx.mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    seen = {"samples": 0}                               # the data position, recorded with every snapshot
    ckpt = hpcft.Checkpointer(model, optimizer, hpcft.Options(every=args.every, job_id=common.job_id(ctx, "fsdp2")),
                              extra=lambda: dict(seen), dp_group=ctx.dp_group)
    start = ckpt.restore()                              # the steps already done: 0 on a fresh run
    seen.update(ckpt.extra or {})

    for step in range(start, args.steps):
        inputs, targets = common.batch(args, step, ctx.dp_rank, ctx.device)
        loss = common.lm_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()                                 # FSDP2 reduce-scatters the gradients here
        seen["samples"] += len(inputs) * ctx.dp
        optimizer.step()                                # hpcft snapshots in the optimizer's post-step hook
        common.after_step(args, ctx, step, loss)
    return common.finish(args, ctx, ckpt, model, optimizer, seen)


if __name__ == "__main__":
    sys.exit(main())
