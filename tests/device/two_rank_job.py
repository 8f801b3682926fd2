#!/usr/bin/env python3
"""A multi-process job through the documented flow: `hpcft.init()`, `Checkpointer(model, opt,
dp_group=ctx.dp_group)`, `restore()`, a few data-parallel steps; then a second launch of the same job that
restores and checks that every parameter and optimizer tensor is bit-identical to the first run's state.
The ranks get torch's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
as torchrun gives them, so `hpcft.init()` reads them as a torchrun job: one GPU per rank where there are
GPUs (nccl/rccl), gloo on CPUs.

  two_rank_job.py --launch 2 [--device cpu] [--steps 3] [--out DIR]   both launches; exit 0 when identical
  two_rank_job.py --phase first|second --out DIR --root R --job-id J  one rank (the launcher starts these)

tests/device/check.sh runs it on a GPU machine with two or more GPUs; tests/unit/test_two_rank_job.py runs
it on CPU with gloo on every CI run.
"""
import argparse
import os
import socket
import subprocess
import sys
import tempfile
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
D = 32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, device: str, steps: int, out: Path, timeout: float) -> int:
    """Run the job twice on `world` local ranks; 0 when the second launch restored the first's state."""
    root = Path(tempfile.mkdtemp(prefix="hpcft-two-rank-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    out.mkdir(parents=True, exist_ok=True)
    base = {k: v for k, v in os.environ.items() if k != "HPCFT_RANK"}  # hpcft's own launcher variables win
    base.update(OMP_NUM_THREADS="1", HPCFT_EVENT_DIR=str(out / "events"),
                PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    if device == "cpu":  # hpcft.init() picks a GPU wherever one is visible
        base.update(CUDA_VISIBLE_DEVICES="", HIP_VISIBLE_DEVICES="")
    job = f"two-rank-{os.getpid()}"
    try:
        for phase in ("first", "second"):
            port = str(_free_port())
            procs = [subprocess.Popen(
                [sys.executable, __file__, "--phase", phase, "--out", str(out), "--root", str(root),
                 "--job-id", job, "--steps", str(steps)],
                env={**base, "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
                     "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
            failed = False
            for r, p in enumerate(procs):
                try:
                    text, _ = p.communicate(timeout=timeout)
                except subprocess.TimeoutExpired:
                    for q in procs:
                        q.kill()
                    text, _ = p.communicate()
                (out / f"{phase}-rank{r}.log").write_text(text)
                if p.returncode != 0:
                    failed = True
                    print(f"--- {phase} launch, rank {r}: exit {p.returncode}\n{text[-3000:]}")
            if failed:
                print(f"two-rank job: FAILED in the {phase} launch (logs in {out})")
                return 1
        print(f"two-rank job: ok ({world} ranks, {device}: the relaunch restored step {steps} bit-identical)")
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


def rank(phase: str, out: Path, root: str, job_id: str, steps: int) -> int:
    """One rank of one launch; a message and exit status 1 on any difference."""
    import torch
    import torch.distributed as dist

    import hpcft
    from hpcft.snapshot.state import collect

    ctx = hpcft.init()
    torch.manual_seed(0 if phase == "first" else 1)  # the relaunch starts from other weights: restore must fix them
    model = torch.nn.Sequential(torch.nn.Linear(D, 4 * D), torch.nn.Tanh(), torch.nn.Linear(4 * D, D)).to(ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def state() -> dict[str, torch.Tensor]:
        return {e.name: e.local.detach().to("cpu", copy=True) for e in collect(model, opt, None)}

    ckpt = hpcft.Checkpointer(model, opt, hpcft.Options(root=root, job_id=job_id), dp_group=ctx.dp_group)
    start = ckpt.restore()
    saved = out / f"state-rank{ctx.rank}.pt"
    if phase == "first":
        if start != 0:
            print(f"rank {ctx.rank}: a fresh job restored step {start}")
            return 1
    else:
        want, got = torch.load(saved), state()
        differ = sorted(k for k in want.keys() | got.keys() if k not in want or k not in got or not torch.equal(want[k], got[k]))
        if start != steps or differ:
            print(f"rank {ctx.rank}: restored step {start} (want {steps}); tensors that differ: {differ}")
            return 1
    for it in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * it + ctx.dp_rank)
        model(torch.randn(16, D, generator=g).to(ctx.device)).pow(2).mean().backward()
        for p in model.parameters():  # data parallel by hand: any group hpcft.init() made carries it
            dist.all_reduce(p.grad, group=ctx.dp_group)
            p.grad.div_(ctx.dp)
        opt.step()
        opt.zero_grad()
    ckpt.wait()
    if phase == "first":
        torch.save(state(), saved)
    print(f"rank {ctx.rank}/{ctx.world} {phase}: ok on {ctx.device} ({ctx.backend}), restored {start}, "
          f"now at step {ckpt.completed}")
    ckpt.close()
    ctx.close()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launch", type=int, metavar="N", help="run both launches on N local ranks")
    ap.add_argument("--device", choices=["auto", "cpu"], default="auto", help="cpu: hide the GPUs (gloo)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=240, help="seconds per launch")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--phase", choices=["first", "second"])
    ap.add_argument("--root")
    ap.add_argument("--job-id")
    args = ap.parse_args()
    if args.launch:
        return launch(args.launch, args.device, args.steps, args.out or Path(tempfile.mkdtemp()), args.timeout)
    if not (args.phase and args.out and args.root and args.job_id):
        ap.error("a rank needs --phase, --out, --root and --job-id (or use --launch N)")
    sys.path.insert(0, str(REPO))
    return rank(args.phase, args.out, args.root, args.job_id, args.steps)


if __name__ == "__main__":
    sys.exit(main())
