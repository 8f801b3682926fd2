"""A data-parallel job for the durable tier's tests, run by launch.py: `train --steps N --per-node P` trains a bf16
model (a mixed bf16/fp32 state: AdamW's step counters are fp32) with hpcft snapshots every step, each "node" (P
consecutive ranks) with its own store root under $HPCFT_STORE_ROOT, so that one agent per node flushes it; it
restores first (from memory, or with `--persist DIR [--local DIR]` the durable tier: each node's first level is
`<local>/node<n>`), and rank 0 saves the state after every step as `ref-<step>.pt` (the replicas are identical) for
the test to compare a durable checkpoint with, and with `--dump NAME` the state restore gave as `NAME.pt`. With
`--hold-at S --hold-file F` every rank waits after step S (its snapshot taken, `ref-S.pt` saved; it says so in
<out>/held.<rank>) until F exists: a test flushes that step while the job lives on."""
import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import hpcft

WIDTH = 96  # rows of 96 bf16: the shares cut tensors mid-row


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, 3 * WIDTH), torch.nn.Tanh(),
                                torch.nn.Linear(3 * WIDTH, WIDTH)).to(torch.bfloat16)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=["train"])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--per-node", type=int, default=2)
    ap.add_argument("--persist", default=None)
    ap.add_argument("--local", default=None)
    ap.add_argument("--dump", default=None)
    ap.add_argument("--hold-at", type=int, default=-1)
    ap.add_argument("--hold-file", type=Path)
    args = ap.parse_args()
    ctx = hpcft.init()
    rank = dist.get_rank()
    root = Path(os.environ["HPCFT_STORE_ROOT"]) / f"node{rank // args.per_node}"
    root.mkdir(exist_ok=True)
    model, opt = model_and_optimizer()
    node_local = Path(args.local) / f"node{rank // args.per_node}" if args.local else "none"
    ckpt = hpcft.Checkpointer(model, opt, hpcft.Options(root=root, persist_dir=args.persist, persist_local=node_local),
                              dp_group=dist.group.WORLD)
    start = ckpt.restore()
    if args.dump and rank == 0:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": start}, args.out / f"{args.dump}.pt")
    for it in range(start, args.steps):
        g = torch.Generator().manual_seed(it * 100 + rank)
        x = torch.randn(8, WIDTH, generator=g).to(torch.bfloat16)
        model(x).float().square().mean().backward()
        for p in model.parameters():  # data-parallel: average the gradients
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        opt.step()
        opt.zero_grad()
        ckpt.wait()
        if rank == 0:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, args.out / f"ref-{it + 1}.pt")
        if it + 1 == args.hold_at:
            (args.out / f"held.{rank}").touch()
            while not args.hold_file.exists():
                time.sleep(0.05)
    ckpt.close()
    dist.barrier()
    del ctx


if __name__ == "__main__":
    main()
