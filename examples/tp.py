"""Tensor parallel inside a node and data parallel across nodes (DTensor, torch.distributed.tensor.parallel), made
fault-tolerant with hpcft: each block's attention and MLP are sharded over the node's ranks as Megatron does
(q, k, v and fc by columns, proj and out by rows), the replicas average their gradients across nodes.

  python examples/tp.py                                          # a laptop: one process, tensor parallel of 1
  hpcft run --tasks-per-node 2 --spares 1 -- python examples/tp.py   # TP = the tasks per node, DP = the nodes
  sbatch examples/frontier/tp.sbatch                             # Frontier: TP 8 (one rank per GCD)

hpcft snapshots each rank's shards (and its copy of the replicated rest, split across the data-parallel replicas)
and restores them bit for bit; a resumed run equals an uninterrupted one.
"""
import sys

import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import common
import hpcft
from hpcft.env import job_env

# Megatron's split of a block: no communication inside attention or the MLP, one all-reduce after each
PLAN = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(), "mlp.fc": ColwiseParallel(), "mlp.out": RowwiseParallel()}


def main() -> int:
    p = common.parser(__doc__)
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: the tasks per node)")
    args = p.parse_args()

    ctx = hpcft.init(tp=args.tp or job_env().local_world_size)   # mesh (pp, dp, tp): tp inside a node
    common.setup(args, ctx)
    if args.heads % ctx.tp:
        raise SystemExit(f"--heads {args.heads} must be a multiple of the tensor-parallel size {ctx.tp}")
    model = common.TinyGPT(args).to(ctx.device)
    for block in model.blocks:
        parallelize_module(block, ctx.mesh["tp"], PLAN)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    seen = {"samples": 0}                                        # the data position, recorded with every snapshot
    ckpt = hpcft.Checkpointer(model, optimizer, hpcft.Options(every=args.every, job_id=common.job_id(ctx, "tp")),
                              extra=lambda: dict(seen), dp_group=ctx.dp_group)
    start = ckpt.restore()                                       # the steps already done: 0 on a fresh run
    seen.update(ckpt.extra or {})

    for step in range(start, args.steps):
        inputs, targets = common.batch(args, step, ctx.dp_rank, ctx.device)  # one batch per replica
        loss = common.lm_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        common.average_gradients(model, ctx.dp_group)           # across the replicas, shard by shard
        seen["samples"] += len(inputs) * ctx.dp
        optimizer.step()                                         # hpcft snapshots in the optimizer's post-step hook
        common.after_step(args, ctx, step, loss)
    return common.finish(args, ctx, ckpt, model, optimizer, seen)


if __name__ == "__main__":
    sys.exit(main())
