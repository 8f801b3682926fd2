"""The training job of `hpcft bench recovery` (a copy of the sandbox tests' DP job, extended): run under srun,
one task per node, it appends timestamped records to $OUT/timeline.jsonl so the bench can split a recovery
into process start, imports, process group, model construction, restore and first step.

CKPT=hpcft (default) snapshots every step with hpcft's Checkpointer and resumes from node memory;
CKPT=disk is the baseline: rank 0 `torch.save`s model + optimizer to $OUT/ckpt.pt every step (written, then
renamed) and every rank resumes with `torch.load`. WIDTH × LAYERS sets the model size (square Linear layers).
HOLD_AT=S HOLD_FILE=F: the first run waits after step S until F exists (the bench's node crash waits there for
the agents to protect a step, so the fault does not race a short job to its end).
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


def main() -> int:
    out = Path(os.environ["OUT"])
    rank_hint = int(os.environ.get("HPCFT_RANK", os.environ.get("SLURM_PROCID", "0")))
    _record(out, "start", rank=rank_hint, t=_T0)

    import torch
    import torch.distributed as dist

    import hpcft

    _record(out, "imported", rank=rank_hint)
    total = int(os.environ.get("STEPS", "40"))
    delay = float(os.environ.get("STEP_DELAY", "0"))
    width, layers = int(os.environ.get("WIDTH", "256")), int(os.environ.get("LAYERS", "2"))
    mode = os.environ.get("CKPT", "hpcft")
    hold_at = int(os.environ.get("HOLD_AT", "-1"))
    hold_file = Path(os.environ["HOLD_FILE"]) if os.environ.get("HOLD_FILE") else None
    first_run = os.environ.get("HPCFT_RESTART_COUNT", "0") == "0"
    torch.set_num_threads(1)
    # No torch.use_deterministic_algorithms(True) here (the DP test job's choice): its first call costs ~3.6 s
    # of lazy imports per process on this machine, which is training-script start-up, not recovery.
    torch.manual_seed(0)
    ctx = hpcft.init()
    _record(out, "init", rank=ctx.rank)
    model = torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.Tanh())])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt_file = out / "ckpt.pt"
    ckpt = None if mode == "disk" else hpcft.Checkpointer(model, opt, dp_group=ctx.dp_group)
    # The first model/AdamW construction pays ~4 s of torch's lazy imports here: start-up, not restore.
    _record(out, "built", rank=ctx.rank)
    if ckpt is None:
        start = 0
        if ckpt_file.exists():
            saved = torch.load(ckpt_file, weights_only=True)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            start = saved["step"] + 1
    else:
        start = ckpt.restore()
    _record(out, "restored", rank=ctx.rank, step=start)
    for step in range(start, total):
        g = torch.Generator().manual_seed(1000 * step + ctx.rank)
        x = torch.randn(16, width, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), x.tanh())
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= ctx.world
        opt.step()
        if mode == "disk" and ctx.rank == 0:
            tmp = ckpt_file.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, ckpt_file)
        _record(out, "step", rank=ctx.rank, step=step)
        time.sleep(delay)
        if hold_file and step == hold_at and first_run:
            while not hold_file.exists():
                time.sleep(0.05)
    if ckpt is not None:
        ckpt.wait()
        ckpt.close()
    dist.barrier()
    dist.destroy_process_group()
    _record(out, "done", rank=ctx.rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
