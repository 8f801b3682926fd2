"""Durable-tier scenarios, run as real gloo ranks by launch.py (`script=` this file):

  save   4 ranks train a bf16 model (fp32 buffer and AdamW step counters: mixed dtypes) 3 steps, as DP with
         dp_group (shares cut tensors mid-row) and as FSDP2 on the 4-rank mesh (uneven shards); each rank flushes its
         snapshot to <out>/persist-<kind>, rank 0 commits; rank 0 saves the full state (`ref-<kind>.pt`), every rank
         its RNG state
  load   at any world size (in fresh processes, or after `save` in the same ranks: `save,load`), into fresh models,
         optimizers and stores: a plain dcp.load equals the reference bit for bit;
         hpcft's reader (Checkpointer.restore, memory empty; resharded where the world size differs) equals the DCP
         load bit for bit, with saved rank r's RNG state and extra; a checkpoint only rank 0 sees restores step 0 on
         every rank
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import hpcft
from hpcft.durable import catalog, commit, files, flush
from hpcft.snapshot import state as hstate

D = 22  # rows of 22 bf16 (44 bytes): the data-parallel shares cut them mid-row; FSDP2 shards 66 rows unevenly
KINDS = ("dp", "fsdp")


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit: dtype, shape and bytes."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def entries_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """A copy of a plain model's and optimizer's tensors by hpcft entry name (`model/<n>`, `optim/<param>/<key>`)."""
    out = {f"model/{k}": v.clone() for k, v in model.state_dict().items()}
    for p, n in zip(model.parameters(), dict(model.named_parameters())):
        out.update({f"optim/{n}/{k}": v.clone() for k, v in opt.state[p].items()})
    return out


def flush_rank(store, version, persist: Path, world: int, job: str) -> Path:
    """Write one rank's `version` into the flush directory of its step under `persist` (what an agent does); with
    world 1, commit it too. The flush directory."""
    tmp = persist / catalog.tmp_name(version.step, f"{job}-t")
    files.make_dir(flush.sidecar_dir(tmp))
    flush.write_rank(version.manifest, store.slot(version.slot, create=False).array, tmp, sync=False)
    if world == 1:
        commit.commit(tmp, persist, version.step, 1, job, keep=4)
    return tmp


def build(kind: str, ctx, fsdp: bool = True) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(D, 3 * D), torch.nn.Tanh(), torch.nn.Linear(3 * D, D))
    model.to(torch.bfloat16).register_buffer("seen", torch.zeros(3))
    if kind == "fsdp" and fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=ctx.mesh["dp"])
        fully_shard(model, mesh=ctx.mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train(kind: str, ctx, model, opt, steps: int) -> None:
    for it in range(steps):
        x = torch.randn(4, D, generator=torch.Generator().manual_seed(100 * it + ctx.rank)).to(torch.bfloat16)
        model(x).float().square().mean().backward()
        if kind == "dp":
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= ctx.world
        with torch.no_grad():
            model.get_buffer("seen").add_(1)
        torch.rand(3)  # the torch RNG moves every step
        opt.step()
        opt.zero_grad()


def full(model, opt) -> dict[str, torch.Tensor]:
    """The unsharded state as DCP names it (collective for FSDP2)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    out = {f"model.{k}": v for k, v in msd.items()}
    out.update({f"optim.state.{p}.{k}": v for p, st in osd["state"].items() for k, v in st.items()})
    return {k: v.clone() for k, v in out.items()}


def dcp_load(kind: str, ctx, path: Path, fsdp: bool = True) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A fresh model and optimizer loaded by plain torch.distributed.checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = build(kind, ctx, fsdp)
    hstate.ensure_optimizer_state(opt)
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    return model, opt


def hpcft_load(kind: str, ctx, persist: Path, job: str, fsdp: bool = True, root: Path | None = None):
    """A fresh model (other values, other RNG) restored by hpcft from the durable tier (its memory is empty; store
    root `root`, default $HPCFT_STORE_ROOT)."""
    model, opt = build(kind, ctx, fsdp)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    torch.manual_seed(5)
    dp = getattr(ctx, "dp_group", None) if kind == "dp" else None
    with hpcft.Checkpointer(model, opt, hpcft.Options(job_id=job, persist_dir=persist, root=root), dp_group=dp) as ck:
        step, extra = ck.restore(), ck.extra
    return model, opt, step, extra


def diff(a: dict, b: dict) -> list[str]:
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not same(a[k], b[k]))


def save(args, ctx) -> dict:
    out, report = Path(args.out), {}
    for kind in KINDS:
        persist = out / f"persist-{kind}"
        persist.mkdir(exist_ok=True)
        model, opt = build(kind, ctx)
        dp = ctx.dp_group if kind == "dp" else None
        with hpcft.Checkpointer(model, opt, hpcft.Options(job_id=f"w-{kind}"), dp_group=dp,
                                extra=lambda: {"rank": ctx.rank}) as ck:
            train(kind, ctx, model, opt, 3)
            ck.wait()
            rng = torch.get_rng_state()
            tmp = flush_rank(ck.store, ck.store.versions()[-1], persist, ctx.world, f"w-{kind}")
        dist.barrier()
        if ctx.rank == 0:
            commit.commit(tmp, persist, 3, ctx.world, f"w-{kind}", keep=2)
        dist.barrier()
        ref = full(model, opt)
        if ctx.rank == 0:
            torch.save(ref, out / f"ref-{kind}.pt")
        torch.save(rng, out / f"rng-{kind}-rank{ctx.rank}.pt")
        report[kind] = {"entries": len(ref)}
    return {**report, "ok": True}


def load(args, ctx) -> dict:
    out, report = Path(args.out), {}
    for kind in KINDS:
        persist = out / f"persist-{kind}"
        ref = torch.load(out / f"ref-{kind}.pt", weights_only=True)
        by_dcp = dcp_load(kind, ctx, persist / "step-3")
        bad_dcp = diff(ref, full(*by_dcp))
        model, opt, step, extra = hpcft_load(kind, ctx, persist, f"r{ctx.world}-{kind}")
        rng = torch.load(out / f"rng-{kind}-rank{ctx.rank}.pt", weights_only=True)
        rng_equal = torch.equal(torch.get_rng_state(), rng)
        local = {e.name: e.local for e in hstate.collect(model, opt, None)}
        dcp_local = {e.name: e.local for e in hstate.collect(*by_dcp, None)}
        report[kind] = {"dcp_mismatch": bad_dcp, "hpcft_vs_dcp": diff(dcp_local, local), "step": step,
                        "extra": extra, "rng_equal": rng_equal, "entries": len(local)}
    # the checkpoint seen by rank 0 only (a node-local directory): not complete everywhere, so step 0 for both,
    # said as an error
    model, opt = build("dp", ctx)
    seen = out / "persist-dp" if ctx.rank == 0 else out / f"empty-{ctx.rank}"
    with hpcft.Checkpointer(model, opt, hpcft.Options(job_id="partial", persist_dir=seen), dp_group=ctx.dp_group) as ck:
        report["partial_start"] = ck.restore()
    report["ok"] = all(not r["dcp_mismatch"] and not r["hpcft_vs_dcp"] and r["step"] == 3 and r["rng_equal"]
                       and r["extra"] == {"rank": ctx.rank} for r in (report[k] for k in KINDS)) \
        and report["partial_start"] == 0
    return report


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenarios", help="save, load, or save,load (one after the other in the same ranks)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ctx = hpcft.init()
    ok = True
    for scenario in args.scenarios.split(","):
        report = {"save": save, "load": load}[scenario](args, ctx)
        Path(args.out, f"{scenario}-w{ctx.world}-rank{ctx.rank}.json").write_text(json.dumps(report, default=str))
        ok = ok and report["ok"]
        dist.barrier()
    ctx.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
