"""A data-parallel job under hpcft.restartable, run as real ranks by launch.py (gloo, CPU): a kept model and
optimizer, a Checkpointer per generation, a manual gradient all-reduce; faults injected by flags.

  run --steps N --tag T [--raise-at S --raise-rank R --raise-gens 0[,1..]] [--kill-at S --kill-rank R]
      [--max-restarts M] [--barrier-timeout T] [--backend B]
Writes OUT/final-T-rank<r>.pt (parameters and optimizer state) and OUT/T-rank<r>.json (generations, pids, starts).
"""
import argparse
import faulthandler
import json
import logging
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import hpcft

D = 16


def grad_group(ctx):
    """ctx's dp group where it carries CPU tensors, else a gloo group of the same ranks (a GPU job's device traffic)."""
    if "cpu:" in dist.get_backend_config(ctx.dp_group):
        return ctx.dp_group
    return dist.new_group(dist.get_process_group_ranks(ctx.dp_group), backend="gloo")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("scenario")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--tag", default="run")
    p.add_argument("--raise-at", type=int, default=-1)
    p.add_argument("--raise-rank", type=int, default=1)
    p.add_argument("--raise-gens", default="0")
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--kill-rank", type=int, default=2)
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--barrier-timeout", type=float, default=60.0)
    p.add_argument("--backend", default=None)
    args = p.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a stack dump on demand, for a hang
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    out = Path(args.out)
    raise_gens = {int(g) for g in args.raise_gens.split(",") if g}
    seen: list[dict] = []
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    @hpcft.restartable(max_restarts=args.max_restarts, barrier_timeout_s=args.barrier_timeout)
    def train(attempt: hpcft.Attempt) -> None:
        ctx = attempt.init(backend=args.backend)
        kept = attempt.state
        if not kept:  # generation 0 builds; later ones keep the objects and restore them in place
            torch.manual_seed(0)
            kept["model"] = torch.nn.Sequential(torch.nn.Linear(D, 4 * D), torch.nn.Dropout(0.1), torch.nn.Tanh(),
                                                torch.nn.Linear(4 * D, 1))
            kept["opt"] = torch.optim.AdamW(kept["model"].parameters(), lr=1e-2, weight_decay=0.1)
            torch.manual_seed(7 + ctx.rank)
        model, opt = kept["model"], kept["opt"]
        group = grad_group(ctx)
        pos = {"pos": 0}
        with hpcft.Checkpointer(model, opt, extra=lambda: dict(pos), dp_group=ctx.dp_group) as ckpt:
            start = ckpt.restore()
            pos.update(ckpt.extra or {})
            seen.append({"generation": attempt.generation, "pid": os.getpid(), "start": start, "cause": attempt.cause})
            for it in range(start, args.steps):
                x = torch.randn(8, D, generator=torch.Generator().manual_seed(1000 * it + ctx.dp_rank))
                loss = model(x).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                if it == args.raise_at and ctx.rank == args.raise_rank and attempt.generation in raise_gens:
                    raise RuntimeError(f"injected fault at step {it}")
                if it == args.kill_at and ctx.rank == args.kill_rank and attempt.generation == 0:
                    os.kill(os.getpid(), signal.SIGKILL)
                for prm in model.parameters():
                    dist.all_reduce(prm.grad, group=group)
                    prm.grad /= ctx.dp
                pos["pos"] = it + 1
                opt.step()
        final = {k: v.clone() for k, v in model.state_dict().items()}
        final.update({f"opt.{i}.{k}": v for i, s in opt.state_dict()["state"].items() for k, v in s.items()})
        torch.save(final, out / f"final-{args.tag}-rank{ctx.rank}.pt")
        dist.destroy_process_group()

    train()
    rank = int(os.environ["HPCFT_RANK"])
    (out / f"{args.tag}-rank{rank}.json").write_text(json.dumps(seen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
