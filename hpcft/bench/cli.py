"""`hpcft bench …`: benchmarks that report ratios against baselines measured in the same run (docs/results.md).
Each command's options are the fields of its module's `<Name>Options`, which `_run` builds from them."""
import importlib
from collections.abc import Callable
from typing import Any

import click

from hpcft.agent.protection.budget import LAG_STEPS

_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9}


class Count(click.ParamType):
    """A positive count such as 50000000, 50M, 1.5M or 1e6."""

    name = "count"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        text = str(value).strip().lower()
        scale = _SUFFIXES.get(text[-1:], 1)
        try:
            number = float(text[:-1] if scale != 1 else text) * scale
        except ValueError:
            self.fail(f"{value!r} is not a count; write e.g. 50000000, 50M or 1e6", param, ctx)
        if number < 1:
            self.fail(f"{value!r} must be at least 1", param, ctx)
        return int(number)


class Listed(click.ParamType):
    """A comma-separated list of names, or of counts each at least 1 (`counts`)."""

    name = "list"

    def __init__(self, counts: bool = False) -> None:
        self.counts = counts

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple:
        items = value if isinstance(value, tuple) else tuple(x.strip() for x in str(value).split(",") if x.strip())
        if self.counts and not (items and all(str(x).isdecimal() and int(x) >= 1 for x in items)):
            self.fail(f"{value!r} is not a list of counts, each at least 1; write e.g. 16,64,256", param, ctx)
        return tuple(int(x) for x in items) if self.counts else items


def _options(*options: Callable) -> Callable:
    """One decorator applying `options` in the order given (the order --help lists them)."""
    def apply(func: Callable) -> Callable:
        for option in reversed(options):
            func = option(func)
        return func
    return apply


def _device(ctx: click.Context, param: click.Parameter, device: str) -> str:
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise click.UsageError("--device cuda: torch sees no CUDA/ROCm GPU here; use --device cpu")
    return device


ROOT = click.option("--root", type=click.Path(file_okay=False), default=None,
                    help="Parent dir of the temporary hpcft store (default /dev/shm); removed afterwards.")
OUTPUT = _options(
    click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout; the table goes to stderr."),
    click.option("--runs", type=click.IntRange(min=1), default=1, show_default=True,
                 help="Run the whole bench this many times: each figure is then the median, with its spread."))
COMMON = _options(
    click.option("--params", type=Count(), default="50M", show_default=True,
                 help="Model size in parameters (e.g. 50M, 1M)."),
    click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True,
                 help="Unmeasured calls per variant before timing."),
    click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True, help="torch compute threads."),
    ROOT, OUTPUT)
DEVICE = click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
                      callback=_device, help="Where the model lives (cuda: a CUDA or ROCm GPU through torch.cuda).")


def _run(name: str, as_json: bool, runs: int, **options: Any) -> None:
    """Bench `name`: `hpcft.bench.<name>.run(<Name>Options(**options))` `runs` times, all that libraries print sent
    to stderr; then its report, with the machine it ran on (machine.describe)."""
    from hpcft.bench import machine
    from hpcft.bench.harness import emit, stdout_to_stderr

    module = importlib.import_module(f"hpcft.bench.{name}")
    opts = getattr(module, f"{name.capitalize()}Options")(**options)
    with stdout_to_stderr():
        where = machine.describe(options.get("threads", 2))
        reports = [module.run(opts) for _ in range(runs)]
    emit(reports, as_json, where)


@click.group()
def bench() -> None:
    """Benchmarks. With --json each prints one JSON object on stdout and the table on stderr."""


@bench.command()
@COMMON
@click.option("--steps", type=click.IntRange(min=1), default=20, show_default=True,
              help="Measured training steps per variant.")
@click.option("--block", type=click.IntRange(min=1), default=2, show_default=True,
              help="Consecutive steps of one variant before switching to the next.")
@DEVICE
@click.option("--batch", type=click.IntRange(min=1), default=None,
              help="Sequences per step [default: the shape's, 4]; a GPU needs more for a realistic step.")
@click.option("--flush-every", type=click.IntRange(min=0), default=5, show_default=True,
              help="Steps between the durable flushes of the hpcft_flush variant (0: leave that variant out).")
@click.option("--baselines/--no-baselines", default=True, show_default=True,
              help="Also time torch.save and dcp.async_save every step (on a GPU each costs seconds a step).")
def snapshot(**options: Any) -> None:
    """Step-time overhead of checkpointing every step: hpcft vs torch.save vs dcp.async_save."""
    _run("snapshot", **options)


@bench.command()
@COMMON
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True,
              help="Measured restores per path.")
@DEVICE
def restore(**options: Any) -> None:
    """Restore bandwidth of hpcft from shm vs dcp.load and torch.load from local disk (into a GPU with --device)."""
    _run("restore", **options)


@bench.command()
@COMMON
@click.option("--state", "state_bytes", type=Count(), default="64M", show_default=True,
              help="Bytes of each node's snapshot for the encode/traffic/rebuild figures.")
@click.option("--steps", type=click.IntRange(min=1), default=8, show_default=True,
              help="Measured training steps per variant (with / without protection).")
@click.option("--interval", type=float, default=None,
              help="Seconds between protection rounds [default: the measured step time: a snapshot every step].")
@click.option("--rate", type=float, default=None, help="Agents' bytes/s cap [default: none, as the agent's].")
@click.option("--cpu-share", type=click.FloatRange(0, 1), default=None,
              help="Agents' CPU cap as a fraction of this machine's cores [default: the agent's, 0.01]; 0 for none.")
@click.option("--cpu-cores", type=click.FloatRange(0), default=None,
              help="Agents' CPU cap in cores instead [default, without --cpu-share: the cpu profile's, 0.01, as "
                   "hpcft run gives agents of CPU trainers]; 0 for none.")
@click.option("--nice", type=click.IntRange(0, 19), default=10, show_default=True,
              help="Agents' CPU priority increment (the agent's default).")
@click.option("--protect-lag", "lag_bound", type=click.IntRange(min=0), default=LAG_STEPS, show_default=True,
              help="Steps protection may trail before the agents' cap rises, as hpcft run's --protect-lag (0: off).")
@click.option("--window", type=click.FloatRange(min=1), default=60.0, show_default=True,
              help="Seconds of training with the agents running freely (protection rate, CPU per GB, lag).")
@click.option("--scheme", "schemes", multiple=True, type=click.Choice(["xor", "partner", "rs"]),
              help="Schemes to measure (repeatable) [default: all].")
@click.option("--dir", type=click.Path(file_okay=False), default=None,
              help="Instead: a real job in this running sandbox of 4 nodes (a confined one: `hpcft sandbox up "
                   "--confine`), XOR over them, its ranks holding every core; steps at risk over --window, from "
                   "`hpcft status`'s view (--params, --protect-lag, --cpu-cores as the job's --agent-cores).")
@click.option("--tasks-per-node", type=click.IntRange(min=1), default=2, show_default=True,
              help="With --dir: ranks a node.")
@click.option("--keep", type=click.Path(file_okay=False), default=None,
              help="With --dir: keep the job's output in this directory (default: removed).")
def protect(**options: Any) -> None:
    """Cross-node protection per scheme: encode vs memcpy, bytes sent/stored vs state, rebuild time, step overhead;
    with --dir, protection's lag in a real job laid out as the machine's."""
    from hpcft.launch.config import profiles

    if options["cpu_share"] is not None and options["cpu_cores"] is not None:
        raise click.UsageError("give --cpu-share or --cpu-cores, not both")
    job = {k: options.pop(k) for k in ("dir", "tasks_per_node", "keep")}
    if job["dir"]:
        _run("lag", options["as_json"], options["runs"], dir=job["dir"], params=options["params"],
             tasks_per_node=job["tasks_per_node"], window=options["window"], keep=job["keep"],
             lag_bound=options["lag_bound"], agent_cores=options["cpu_cores"])
        return
    if options["cpu_share"] is None:  # ProtectOptions' default: the agent's
        del options["cpu_share"]
        if options["cpu_cores"] is None:  # the bench trains on the CPU: the cap hpcft run gives such agents
            options["cpu_cores"] = profiles.CPU.agent_cpu_cores
    options["lag_bound"] = options["lag_bound"] or None
    _run("protect", **options)


@bench.command()
@click.option("--agents", type=Listed(counts=True), default="16,64,256", show_default=True,
              help="Comma-separated agent counts N to measure, each a run of N agent processes on loopback.")
@click.option("--group", type=click.IntRange(min=2), default=4, show_default=True,
              help="Protection set size (xor): the bulk peers each agent connects to besides the overlay.")
@click.option("--rounds", type=click.IntRange(min=1), default=10, show_default=True,
              help="Agreement rounds measured per N.")
@click.option("--window", type=click.FloatRange(min=0.5), default=5.0, show_default=True,
              help="Seconds of heartbeats alone over which their traffic is measured.")
@OUTPUT
def scale(**options: Any) -> None:
    """The agents' fabric at scale: N real agent processes on this machine; mesh setup, agreement latency,
    heartbeat traffic and sockets per agent, and their growth with N."""
    _run("scale", **options)


@bench.command()
@click.option("--state-bytes", type=Count(), default="64M", show_default=True, help="Snapshot bytes per node.")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="Launches per scheme and transport (medians reported).")
@click.option("--schemes", type=Listed(), default="xor,partner,rs", show_default=True, help="Comma-separated schemes.")
@click.option("--transports", type=Listed(), default="tcp,mpi", show_default=True, help="Comma-separated transports.")
@ROOT
@OUTPUT
def transport(**options: Any) -> None:
    """The agents' transports side by side (TCP processes vs MPI ranks under mpirun): protect pass and rebuild."""
    _run("transport", **options)


@bench.command()
@click.option("--nodes", type=Listed(counts=True), default="1000,4000,9408", show_default=True,
              help="Comma-separated node counts N, each N connections reporting once a second.")
@click.option("--seconds", type=click.FloatRange(min=1.0), default=10.0, show_default=True,
              help="Seconds of steady reports measured per N.")
@OUTPUT
def reports(**options: Any) -> None:
    """The supervisor's report service at a machine's size: N nodes' steady reports (status delta and 8 ranks'
    progress, once a second each) into one supervisor; its CPU, the reports received, the bounded log."""
    _run("reports", **options)


@bench.command()
@click.option("--dir", type=click.Path(file_okay=False), default=None,
              help="A running sandbox with 4 nodes (default: start one in a temp dir, stop it afterwards).")
@click.option("--window", type=click.FloatRange(min=10), default=60.0, show_default=True,
              help="Seconds measured at steady state.")
@click.option("--warmup", type=click.FloatRange(min=0), default=20.0, show_default=True,
              help="Seconds of training after every agent protected a step, before the window.")
@click.option("--slurm-check-every", type=click.FloatRange(min=0, min_open=True), default=None,
              help="hpcft run --slurm-check-every for the job [default: hpcft run's].")
@click.option("--scale", type=click.IntRange(min=1), default=9408, show_default=True,
              help="Nodes the figures are modelled at (Frontier: 9,408).")
@click.option("--keep", type=click.Path(file_okay=False), default=None,
              help="Keep the run's output (job dir, straces) in this directory (default: removed).")
@OUTPUT
def control(**options: Any) -> None:
    """The control plane at steady state, from a real sandbox run: RPCs at slurmctld per minute (sdiag) and
    shared-FS operations per node per minute (strace of hpcft's per-node processes), each modelled at --scale nodes."""
    _run("control", **options)


@bench.command()
@click.option("--dir", type=click.Path(file_okay=False), default=None,
              help="A running sandbox with 6 nodes (default: start one in a temp dir, stop it afterwards).")
@click.option("--steps", type=click.IntRange(min=3), default=30, show_default=True, help="Training steps per run.")
@click.option("--fault-at", type=click.IntRange(min=1), default=8, show_default=True,
              help="The fault comes once every rank has completed this step.")
@click.option("--step-delay", type=float, default=0.2, show_default=True, help="Seconds of sleep after each step.")
@click.option("--width", type=click.IntRange(min=1), default=1024, show_default=True, help="Model width.")
@click.option("--layers", type=click.IntRange(min=1), default=4, show_default=True, help="Linear layers.")
@click.option("--poll-interval", type=float, default=0.5, show_default=True, help="hpcft run --poll-interval.")
@click.option("--keep", type=click.Path(file_okay=False), default=None,
              help="Keep every run's output (job dirs, events, timelines, final.pt) in this new or empty directory, "
                   "one subdirectory per scenario (default: removed unless a run fails).")
@click.option("--baseline", "baselines", multiple=True, type=click.Choice(["relaunch", "requeue"]),
              default=("relaunch", "requeue"),
              help="Baselines to run (repeatable) [default: both]: torch.save every step, then srun again in the "
                   "same allocation (relaunch) or scontrol requeue (requeue), and torch.load.")
@click.option("--crash", type=click.Choice(["kill", "silent"]), default="kill", show_default=True,
              help="The node crash: its processes killed (their connections close at once, which peers notice at "
                   "once), or silent (frozen: no connection closes, nothing answers, as after a power loss), "
                   "powered off once the supervisor decided.")
@click.option("--reference", type=click.Path(file_okay=False), default=None,
              help="The output directory of a finished fault-free run of the same job (--steps, --width, --layers; "
                   "its final.pt) to compare the faulted runs with, instead of making one first.")
@OUTPUT
def recovery(**options: Any) -> None:
    """Fault → first step after it, in the sandbox: rank kill, node crash, batch host, and what a user does
    without hpcft (torch.save, relaunch in the allocation or requeue, torch.load)."""
    if options["keep"] and options["runs"] > 1:
        raise click.UsageError("--keep keeps one run's output: give it with --runs 1")
    _run("recovery", **options)


@bench.command()
@click.option("--from", "data_dir", type=click.Path(file_okay=False), default="docs/results/data", show_default=True,
              help="The saved --json objects: <bench>.json and chaos-*.json (notes on earlier figures: ../notes/).")
@click.option("--out", type=click.Path(dir_okay=False), default="docs/results.md", show_default=True,
              help="The page to write.")
@click.option("--img", type=click.Path(file_okay=False), default="docs/img", show_default=True,
              help="Where its PNGs go (with matplotlib: pip install 'hpcft[plots]').")
@click.option("--run", is_flag=True, help="Run the benches first and save each object in --from.")
@click.option("--quick", is_flag=True,
              help="With --run: small sizes, 10 to 20 minutes in all on 2 cores (most of it recovery and protect).")
@click.option("--bench", "benches", multiple=True, type=click.Choice(["snapshot", "restore", "protect", "transport",
                                                                     "recovery", "scale", "reports",
                                                                     "control"]),
              help="With --run: only this bench (repeatable) [default: all; recovery needs root].")
def page(**options: Any) -> None:
    """Write the results page (docs/results.md) and its plots from the benches' saved --json objects."""
    from hpcft.bench import page as results

    results.main(**options)
