"""A small data-parallel training job, the one run by `hpcft bench recovery` and the sandbox tests: under srun,
one task per node, a per-parameter all-reduce (bitwise: docs/reference/checkpointing.md), snapshots every
step with hpcft's Checkpointer and resumes from them when relaunched.

Environment (all optional but OUT):
  OUT            directory for what the job writes: progress.<rank> (last completed step), start.<rank>.<step id>
                 (the step a launch resumed from), timeline.jsonl (timestamped records, so the bench can split a
                 recovery into process start, imports, process group, model, restore and first step) and, from
                 rank 0 at the end, final.pt (parameters and the data position)
  STEPS=40 STEP_DELAY=0   steps to run, seconds of sleep after each
  WIDTH=32 LAYERS=2 DROPOUT=0.1   `LAYERS` × (Linear(WIDTH, WIDTH), Dropout, Tanh) + Linear(WIDTH, 1), AdamW
  SYNC=manual|ddp  `ddp` wraps the model in DDP (resumes equal to a few ulps only: docs/reference/checkpointing.md)
  TP=1           tensor parallel inside a node, as Megatron does it by hand: each hidden layer is a column-parallel
                 Linear and a row-parallel one whose outputs are summed over the tp group; data parallel across
                 nodes (`hpcft run --tasks-per-node TP`). Every rank also writes final.<rank>.pt
  BACKEND=       hpcft.init()'s backend, e.g. `cuda:gloo`: groups that refuse CPU tensors, as NCCL/RCCL ones do;
                 the job's own gradient traffic then goes on gloo groups of the same ranks (its "device" groups)
  CKPT=hpcft|disk  `disk` is the bench's baseline: rank 0 `torch.save`s model + optimizer to OUT/ckpt.pt every
                 step (written, then renamed) and every rank resumes with `torch.load`
  HOLD_AT=S[,S2,…] HOLD_FILE=F[,F2,…]   launch k (HPCFT_RESTART_COUNT) waits after step S_k until F_k (or the last
                 file named) exists: a fault, a shrink, a grow must not race the job's end; a launch without S_k does
                 not wait
  HANG_AT=S HANG_RANK=R   in the first launch, rank R stops making progress after step S (a hang to detect)
  RAISE_AT=S RAISE_RANK=R [MAX_RESTARTS=1]   run under hpcft.restartable; in the first launch's first generation
                 rank R raises at step S (after its backward, before the all-reduce); every rank restarts in process
                 (records carry `gen`; a `raise` record marks the fault's time). TP=1 only: the TP blocks hold their
                 tp group, so a kept TP model keeps the old generation's sockets open and the restart gives up at the
                 barrier timeout (exit 1, the relaunch path; docs/reference/checkpointing.md "In-process restart")
  CHAOS=1        SIGUSR2 raises a RuntimeError in the main thread (`hpcft chaos`'s exception fault)
  BATCH=plan     the elastic arithmetic (hpcft.batch_plan, docs/reference/elastic.md): a step takes the
                 plan's micro-batches of 16 samples, micro-batch u of the data stream drawn from seed u (dropout too),
                 `extra` counts micro-batches consumed; each replica's gradients and losses go into the rows of their
                 micro-batches, all-reduced (one non-zero contributor per row: exact) and summed in micro-batch order,
                 so a step's result does not depend on the number of replicas, bit for bit. The step records carry
                 the step's loss (`loss`).
"""
import time

_T0 = time.time()  # before any import: the process start as the bench sees it

import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402


def _record(out: Path, what: str, **fields) -> None:
    """One JSON line per event, written in one call to a file opened O_APPEND: the ranks' lines stay whole."""
    tag = f"{os.environ.get('SLURM_RESTART_COUNT', '0')}.{os.environ.get('HPCFT_RESTART_COUNT', '0')}"
    with open(out / "timeline.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"what": what, "t": time.time(), "run": tag, "pid": os.getpid(), **fields}) + "\n")


def _int(name: str, default: int) -> int:
    return int(os.environ.get(name, str(default)))


def _sum_over(group):
    """Megatron's reduce-from-tensor-parallel region on `group`: forward all-reduces the partial sums, backward is
    the identity (every tp rank already holds the whole gradient of the summed output)."""
    import torch
    import torch.distributed as dist

    class Sum(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y):
            y = y.clone()
            dist.all_reduce(y, group=group)
            return y

        @staticmethod
        def backward(ctx, grad):
            return grad

    return Sum.apply


def _tp_model(width: int, layers: int, dropout: float, ctx, tp_group):
    """`layers` × (column-parallel Linear(width, width/tp), Tanh, row-parallel Linear(width/tp, width), summed over
    tp, + bias, Dropout, Tanh) + Linear(width, 1): shards differ per tp rank, replicas agree across dp."""
    import torch

    total = _sum_over(tp_group)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(100 + ctx.tp_rank)  # this rank's shards; equal on every replica
            self.col = torch.nn.Linear(width, width // ctx.tp)
            self.row = torch.nn.Linear(width // ctx.tp, width, bias=False)
            torch.manual_seed(0)
            self.bias = torch.nn.Parameter(torch.zeros(width))
            self.tail = torch.nn.Sequential(torch.nn.Dropout(dropout), torch.nn.Tanh())

        def forward(self, x):
            return self.tail(total(self.row(torch.tanh(self.col(x)))) + self.bias)

    blocks = [Block() for _ in range(layers)]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(width, 1))


def _grad_groups(ctx):
    """(dp, tp) groups for the job's own gradient traffic: ctx's where they carry CPU tensors, else gloo groups of
    the same ranks, every group made by every rank in the same order (what a GPU job's NCCL groups would be)."""
    import torch.distributed as dist

    if "cpu:" in dist.get_backend_config(ctx.dp_group):
        return ctx.dp_group, ctx.tp_group
    dp_sets = [list(range(t, ctx.world, ctx.tp)) for t in range(ctx.tp)]
    tp_sets = [list(range(d * ctx.tp, (d + 1) * ctx.tp)) for d in range(ctx.world // ctx.tp)]
    made = {tuple(r): dist.new_group(r, backend="gloo") for r in dp_sets + tp_sets}
    mine = [made[tuple(r)] for r in dp_sets + tp_sets if ctx.rank in r]
    return mine[0], mine[1]


def _planned_step(model, opt, plan, seen: dict, width: int, group) -> float:
    """One optimizer step over the plan's micro-batches (BATCH=plan, see the module doc); the step's loss."""
    import torch
    import torch.distributed as dist

    params = list(model.parameters())
    units = plan.micro_batches
    rows = [torch.zeros(units, p.numel()) for p in params]
    losses = torch.zeros(units, dtype=torch.float64)
    for i in plan.mine():
        u = seen["micro_batches"] + i
        with torch.random.fork_rng():
            torch.manual_seed(1_000_003 * u + 7)  # this micro-batch's dropout, whichever replica runs it
            x = torch.randn(16, width, generator=torch.Generator().manual_seed(u))
            loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).tanh(), reduction="sum")
            loss = loss / (16 * units)
            opt.zero_grad()
            loss.backward()
        for row, p in zip(rows, params):
            row[i] = p.grad.flatten()
        losses[i] = loss.item()
    for row in [*rows, losses]:
        dist.all_reduce(row, group=group)
    for row, p in zip(rows, params):
        total = row[0].clone()
        for i in range(1, units):  # in micro-batch order, whatever the replicas
            total += row[i]
        p.grad = total.view_as(p)
    seen["micro_batches"] += units  # before opt.step(): the snapshot taken in its post-step hook records it
    opt.step()
    return float(sum(losses.tolist()))


def _injected(signum, frame) -> None:
    raise RuntimeError(f"an exception injected by hpcft chaos (signal {signum})")


def main() -> int:
    out = Path(os.environ["OUT"])
    rank_hint = int(os.environ.get("HPCFT_RANK", os.environ.get("SLURM_PROCID", "0")))
    _record(out, "start", rank=rank_hint, t=_T0)

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hpcft

    _record(out, "imported", rank=rank_hint, python=sys.executable, torch=torch.__file__,
            node=os.environ.get("SLURMD_NODENAME", ""))
    total, delay = _int("STEPS", 40), float(os.environ.get("STEP_DELAY", "0"))
    width, layers, dropout = _int("WIDTH", 32), _int("LAYERS", 2), float(os.environ.get("DROPOUT", "0.1"))
    mode = os.environ.get("CKPT", "hpcft")
    first_run = os.environ.get("HPCFT_RESTART_COUNT", "0") == "0" and os.environ.get("SLURM_RESTART_COUNT", "0") == "0"
    holds = [int(s) for s in os.environ.get("HOLD_AT", "").split(",") if s]
    launch = _int("HPCFT_RESTART_COUNT", 0) if os.environ.get("SLURM_RESTART_COUNT", "0") == "0" else len(holds)
    hold_at = holds[launch] if launch < len(holds) else -1
    hold_files = [Path(f) for f in os.environ.get("HOLD_FILE", "").split(",") if f]
    hold_file = hold_files[min(launch, len(hold_files) - 1)] if hold_files else None
    hang_at = _int("HANG_AT", -1) if first_run else -1
    if os.environ.get("CHAOS"):  # `hpcft chaos`'s exception fault: SIGUSR2 raises where the main thread is
        signal.signal(signal.SIGUSR2, _injected)
    torch.set_num_threads(1)  # several ranks share this machine's cores
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    tp = _int("TP", 1)
    backend = os.environ.get("BACKEND") or None
    raise_at = _int("RAISE_AT", -1) if first_run else -1
    kept: dict = {}

    def generation(ctx, gen: int) -> None:
        """One run of the training loop on `ctx`'s groups; under RAISE_AT, once per in-process generation (the model
        and optimizer kept in `kept`, restored in place)."""
        _record(out, "init", rank=ctx.rank, gen=gen)
        dp_group, tp_group = _grad_groups(ctx)
        if not kept:
            if tp > 1:
                kept["model"] = _tp_model(width, layers, dropout, ctx, tp_group)
            else:
                body = [m for _ in range(layers)
                        for m in (torch.nn.Linear(width, width), torch.nn.Dropout(dropout), torch.nn.Tanh())]
                kept["model"] = torch.nn.Sequential(*body, torch.nn.Linear(width, 1))  # dropout: RNG hpcft restores
            kept["opt"] = torch.optim.AdamW(kept["model"].parameters(), lr=1e-2)
        model, opt = kept["model"], kept["opt"]
        ddp = DDP(model) if os.environ.get("SYNC", "manual") == "ddp" else model
        seen = {"samples": 0, "micro_batches": 0}
        ckpt_file = out / "ckpt.pt"
        ckpt = hpcft.Checkpointer(model, opt, extra=lambda: dict(seen), dp_group=ctx.dp_group) if mode != "disk" \
            else None
        _record(out, "built", rank=ctx.rank)
        try:
            _body(ctx, gen, model, opt, dp_group, ddp, seen, ckpt, ckpt_file)
        finally:
            if ckpt is not None:
                ckpt.close()

    def _body(ctx, gen, model, opt, dp_group, ddp, seen, ckpt, ckpt_file) -> None:
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
        _record(out, "restored", rank=ctx.rank, step=start, gen=gen)
        (out / f"start.{ctx.rank}.{os.environ.get('SLURM_STEP_ID', 'x')}").write_text(str(start))
        plan = hpcft.batch_plan(ctx) if os.environ.get("BATCH") == "plan" else None
        for step in range(start, total):
            if plan is not None:
                planned = {"loss": _planned_step(model, opt, plan, seen, width, dp_group), "replicas": plan.replicas}
            else:
                planned = {}
                g = torch.Generator().manual_seed(1000 * step + ctx.dp_rank)  # a replica's tp ranks share its batch
                x = torch.randn(16, width, generator=g)
                loss = torch.nn.functional.mse_loss(ddp(x), x.sum(dim=1, keepdim=True).tanh())
                opt.zero_grad()
                loss.backward()
                if step == raise_at and ctx.rank == _int("RAISE_RANK", 0) and gen == 0:
                    _record(out, "raise", rank=ctx.rank, step=step)  # the fault's time, as the bench sees it
                    raise RuntimeError(f"RAISE_AT: injected exception at step {step}")
                if ddp is model:
                    for p in model.parameters():
                        dist.all_reduce(p.grad, group=dp_group)
                        p.grad /= ctx.dp
                seen["samples"] += len(x)  # before opt.step(): the snapshot taken in its post-step hook records it
                opt.step()
            if mode == "disk" and ctx.rank == 0:
                tmp = ckpt_file.with_suffix(".tmp")
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "seen": seen}, tmp)
                os.replace(tmp, ckpt_file)
            (out / f"progress.{ctx.rank}").write_text(str(step))
            _record(out, "step", rank=ctx.rank, step=step, gen=gen, **planned)
            time.sleep(delay)
            if step == hold_at and hold_file is not None:
                while not hold_file.exists():
                    time.sleep(0.05)
            if step == hang_at and ctx.rank == _int("HANG_RANK", 0):
                while True:  # alive, silent: only the supervisor's --hang-timeout can notice
                    time.sleep(3600)
        if ckpt is not None:
            ckpt.wait()
        final = {"params": {k: v.clone() for k, v in model.state_dict().items()}, "seen": seen}
        if ctx.rank == 0:
            torch.save(final, out / "final.pt")
        if tp > 1:
            final["optim"] = {f"{i}.{k}": v for i, s in opt.state_dict()["state"].items() for k, v in s.items()}
            torch.save(final, out / f"final.{ctx.rank}.pt")
        dist.barrier(group=None if "cpu:" in dist.get_backend_config() else dist.new_group(backend="gloo"))
        dist.destroy_process_group()
    if raise_at >= 0:
        hpcft.restartable(lambda attempt: generation(attempt.init(tp=tp, backend=backend), attempt.generation),
                          max_restarts=_int("MAX_RESTARTS", 1))()
    else:
        generation(hpcft.init(tp=tp, backend=backend), 0)
    _record(out, "done", rank=rank_hint)
    # The interpreter's exit would walk torch's (and torch._dynamo's, which the optimizer imports) millions of objects
    # in several full collections: ≈ 1.2 s of CPU per rank, seconds of every launch's end when ranks share cores.
    # Nothing of this job is left to collect: what it wrote is closed.
    gc.freeze()
    return 0


if __name__ == "__main__":
    sys.exit(main())
