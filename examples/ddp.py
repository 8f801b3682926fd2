"""Data parallel with DistributedDataParallel, made fault-tolerant with hpcft: a decoder-only transformer trained on
synthetic tokens with AdamW, an in-memory snapshot after every optimizer step, and a resume from the newest one.

  python examples/ddp.py                                    # a laptop: one process, CPU
  hpcft run --spares 1 -- python examples/ddp.py            # inside a Slurm allocation, one rank per task
  sbatch examples/frontier/ddp.sbatch                       # Frontier (see examples/README.md)

--sync ddp (default) wraps the model in DDP, which reduces gradients in buckets; `settle_buckets` keeps a resumed
run bit-identical to an uninterrupted one (docs/reference/checkpointing.md, "Bitwise resume, and DDP").
--sync allreduce averages each gradient with its own all-reduce instead: no DDP, bitwise too.
"""
import argparse
import sys

import torch
from torch.nn.parallel import DistributedDataParallel

import common
import hpcft


def settle_buckets(net: DistributedDataParallel, args: argparse.Namespace, ctx: hpcft.Context) -> None:
    """One throw-away forward and backward before restore(), so that every launch reduces in the same buckets.

    DDP's first iteration reduces gradients in buckets laid out in parameter order, and then rebuilds them in the order
    its backward produced them: the two sum a gradient's elements in another order, so the first step of a relaunched
    run would differ from the uninterrupted run's in the last bits. After this pass the rebuilt buckets serve every
    real step of every launch, fresh or resumed. No optimizer step is taken, the RNG is left as it was and the gradients
    are dropped; a BatchNorm's statistics, which the pass would change, restore() overwrites, and a fresh run makes
    the same pass.
    """
    inputs, targets = common.batch(args, 0, ctx.dp_rank, ctx.device)
    with torch.random.fork_rng(devices=[ctx.device] if ctx.device.type == "cuda" else []):
        common.lm_loss(net(inputs), targets).backward()
    net.zero_grad(set_to_none=True)


def main() -> int:
    p = common.parser(__doc__)
    p.add_argument("--sync", choices=("ddp", "allreduce"), default="ddp", help="how gradients are averaged")
    args = p.parse_args()

    ctx = hpcft.init()                                  # rank, world, device and process groups from the launcher
    common.setup(args, ctx)
    model = common.TinyGPT(args).to(ctx.device)
    net = model
    if args.sync == "ddp":
        net = DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
        settle_buckets(net, args, ctx)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    seen = {"samples": 0}                               # the data position, recorded with every snapshot
    ckpt = hpcft.Checkpointer(model, optimizer, hpcft.Options(every=args.every, job_id=common.job_id(ctx, "ddp")),
                              extra=lambda: dict(seen), dp_group=ctx.dp_group)
    start = ckpt.restore()                              # the steps already done: 0 on a fresh run
    seen.update(ckpt.extra or {})

    for step in range(start, args.steps):
        inputs, targets = common.batch(args, step, ctx.dp_rank, ctx.device)
        loss = common.lm_loss(net(inputs), targets)
        optimizer.zero_grad()
        loss.backward()                                 # DDP all-reduces the gradients here
        if args.sync == "allreduce":
            common.average_gradients(model, ctx.dp_group)
        seen["samples"] += len(inputs) * ctx.dp         # before the step: its snapshot records the position after it
        optimizer.step()                                # hpcft snapshots in the optimizer's post-step hook
        common.after_step(args, ctx, step, loss)
    return common.finish(args, ctx, ckpt, model, optimizer, seen)


if __name__ == "__main__":
    sys.exit(main())
