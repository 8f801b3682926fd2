"""What the examples share: their options, a small decoder-only transformer, synthetic tokens, and the final state.

Output contract of every example (kept stable: the tests and hpcft's chaos tool rely on it):
  --steps N     train until N optimizer steps are done; a relaunch resumes from its snapshot and goes on to N
  --out DIR     at the end rank 0 writes DIR/final.pt (written, then renamed): {"step": N, "seen": {"samples": S},
                "params": {name: tensor}, "optim": {name: {"step"|"exp_avg"|"exp_avg_sq": tensor}}}, every tensor whole
                (gathered from DTensor and FSDP2 shards) and on the CPU, so two runs compare bit for bit
  exit 0        once final.pt is written (and every rank left the job's process groups)
  data          the batch of step s on data-parallel rank d is a function of (--seed, s, d) only: a resumed run
                trains on exactly the batches an uninterrupted one does
  --sleep S     seconds of sleep after each step, for tests only: a tiny model trains a step in milliseconds, and a
                test that crashes a node mid-run needs the run to last until the node agents protected a snapshot
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def parser(doc: str | None) -> argparse.ArgumentParser:
    """The options every example takes (each script adds its own); sizes default to a model a laptop trains in
    seconds."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="optimizer steps to reach (a resumed run goes on to it)")
    p.add_argument("--out", type=Path, default=None, help="rank 0 writes OUT/final.pt at the end")
    p.add_argument("--width", type=int, default=64, help="model width (d_model)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--heads", type=int, default=4, help="attention heads (a multiple of the tensor-parallel size)")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=8, help="sequences per step on each data-parallel rank")
    p.add_argument("--vocab", type=int, default=256, help="vocabulary size")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and of the data")
    p.add_argument("--every", type=int, default=1, help="take a snapshot every this many steps")
    p.add_argument("--log-every", type=int, default=10, help="rank 0 prints the loss every this many steps")
    p.add_argument("--sleep", type=float, default=0.0, help="seconds after each step (tests only; see common.py)")
    return p


def setup(args: argparse.Namespace, ctx: Any) -> None:
    """Deterministic kernels (a resumed run then equals an uninterrupted one bit for bit) and logging: rank 0 says
    hpcft's events (restored step, its source), the other ranks only warnings."""
    if ctx.device.type != "cpu":  # CPU kernels are deterministic already (and the call imports torch._inductor)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's deterministic mode, before its first use
        torch.use_deterministic_algorithms(True, warn_only=True)  # a kernel without one warns, and resumes may differ
    logging.basicConfig(level=logging.INFO if ctx.rank == 0 else logging.WARNING,
                        format=f"%(asctime)s rank {ctx.rank}: %(message)s")
    if args.heads < 1 or args.width % args.heads:
        raise SystemExit(f"--width {args.width} must be a multiple of --heads {args.heads}")


def job_id(ctx: Any, name: str) -> str | None:
    """The Checkpointer's job id: the job's own under a launcher (None); on a laptop (no launcher, no $HPCFT_JOB_ID)
    one per example, so that an interrupted run resumes when started again and the examples never share a store."""
    return f"example-{name}" if ctx.env.source == "local" and ctx.job_id == "local" else None


class Attention(nn.Module):
    """Causal self-attention with separate q, k, v projections, so tensor parallelism can shard each by columns;
    the head count follows from the (possibly sharded) width."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """The block's 4x GELU MLP (fc by columns, out by rows under tensor parallelism)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block: attention and MLP, each added to the residual stream."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(width), Attention(width, heads)
        self.ln2, self.mlp = nn.LayerNorm(width), MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Token and position embeddings, `--layers` blocks, a final LayerNorm and an LM head; the same initial weights
    on every rank (seeded by --seed)."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        torch.manual_seed(args.seed)
        self.tok, self.pos = nn.Embedding(args.vocab, args.width), nn.Embedding(args.seq, args.width)
        self.blocks = nn.ModuleList(Block(args.width, args.heads) for _ in range(args.layers))
        self.ln, self.head = nn.LayerNorm(args.width), nn.Linear(args.width, args.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def batch(args: argparse.Namespace, step: int, dp_rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of `step` on data-parallel rank `dp_rank`, from a generator seeded by those and --seed
    alone: sequences a, a+b, a+2b, ... (mod vocab), so the next token is learnable from the two before it."""
    g = torch.Generator().manual_seed((((args.seed << 24) + step) << 16) + dp_rank)
    start = torch.randint(args.vocab, (args.batch, 1), generator=g)
    stride = torch.randint(1, args.vocab, (args.batch, 1), generator=g)
    tokens = (start + stride * torch.arange(args.seq + 1)) % args.vocab
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over every position."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def average_gradients(model: nn.Module, group: Any) -> None:
    """Data parallel by hand: one all-reduce per gradient over `group`, then the mean. Each gradient is reduced
    alone, the same way at every step, so a resumed run stays bit-identical (DDP's buckets do not; see ddp.py)."""
    size = dist.get_world_size(group)
    if size == 1:
        return
    for p in model.parameters():
        if p.grad is not None:
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad  # a DTensor's shard (tp.py)
            dist.all_reduce(grad, group=group)
            grad.div_(size)


def after_step(args: argparse.Namespace, ctx: Any, step: int, loss: torch.Tensor) -> None:
    """Rank 0 prints the loss every --log-every steps and at the last; then the test's --sleep, if any."""
    done = step + 1
    if ctx.rank == 0 and (done % args.log_every == 0 or done == args.steps):
        print(f"step {done}/{args.steps} loss {loss.item():.4f}", flush=True)
    if args.sleep:
        time.sleep(args.sleep)


def _whole(t: torch.Tensor, keep: bool) -> torch.Tensor | None:
    """A CPU copy of the whole tensor where `keep`: a DTensor (tensor parallel, FSDP2) is gathered from its shards,
    collectively, on every rank, and dropped at once where not kept (a big model's state fits one host, not eight)."""
    t = t.detach()
    whole = t.full_tensor() if hasattr(t, "full_tensor") else t
    return whole.cpu().clone() if keep else None


def final_state(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, seen: dict, keep: bool = True) -> dict:
    """The contract's final.pt: parameters, buffers and AdamW state by parameter name, whole (collective: every rank
    calls it, in the same order; only where `keep` are the tensors kept)."""
    names = {p: n for n, p in model.named_parameters()}
    optim = {names[p]: {k: _whole(v, keep) for k, v in sorted(s.items())} for p, s in optimizer.state.items()}
    params = {n: _whole(t, keep) for n, t in model.state_dict().items()}
    return {"step": step, "seen": dict(seen), "params": params, "optim": dict(sorted(optim.items()))}


def finish(args: argparse.Namespace, ctx: Any, ckpt: Any, model: nn.Module, optimizer: torch.optim.Optimizer,
           seen: dict) -> int:
    """End of training: the last snapshot committed, with --out final.pt from rank 0, the process groups left; a
    laptop run's snapshots removed (a finished run has nothing to resume). The exit status, 0."""
    ckpt.wait()
    ckpt.close()
    if args.out is not None:
        state = final_state(model, optimizer, args.steps, seen, keep=ctx.rank == 0)
        if ctx.rank == 0:
            args.out.mkdir(parents=True, exist_ok=True)
            torch.save(state, args.out / "final.pt.tmp")
            os.replace(args.out / "final.pt.tmp", args.out / "final.pt")
    if ctx.world > 1:
        dist.barrier()
    ctx.close()
    if ckpt.options.job_id:  # job_id(): a laptop run's own store
        from hpcft.store.paths import job_dir, resolve_root

        shutil.rmtree(job_dir(resolve_root(ckpt.options.root), ckpt.options.job_id), ignore_errors=True)
    gc.freeze()  # the interpreter's exit need not walk torch's millions of objects: ~1 s of CPU a rank
    return 0


__all__ = ["TinyGPT", "after_step", "average_gradients", "batch", "final_state", "finish", "job_id", "lm_loss",
           "parser", "setup"]
