"""`hpcft bench …`: benchmarks that report ratios against baselines measured in the same run."""
from collections.abc import Callable
from typing import Any

import click

_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9}


class Count(click.ParamType):
    """A positive count such as 50000000, 50M, 1.5M or 1e6."""

    name = "count"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        text = str(value).strip().lower()
        scale = _SUFFIXES.get(text[-1:], 1)
        try:
            number = float(text[:-1] if scale != 1 else text) * scale
        except ValueError:
            self.fail(f"{value!r} is not a count; write e.g. 50000000, 50M or 1e6", param, ctx)
        if number < 1:
            self.fail(f"{value!r} must be at least 1", param, ctx)
        return int(number)


def common_options(func: Callable) -> Callable:
    """The options every bench takes: model size, warmup, threads, store root and --json."""
    for option in reversed([
        click.option("--params", type=Count(), default="50M", show_default=True,
                     help="Model size in parameters (e.g. 50M, 1M)."),
        click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True,
                     help="Unmeasured calls per variant before timing."),
        click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True,
                     help="torch compute threads."),
        click.option("--root", type=click.Path(file_okay=False), default=None,
                     help="Parent dir of the temporary hpcft store (default /dev/shm); removed afterwards."),
        click.option("--json", "as_json", is_flag=True,
                     help="One JSON object on stdout; the table goes to stderr."),
        RUNS,
    ]):
        func = option(func)
    return func


RUNS = click.option("--runs", type=click.IntRange(min=1), default=1, show_default=True,
                    help="Run the whole bench this many times: each figure is then the median, with its spread.")


def _run(as_json: bool, bench: Callable[[], Any], runs: int = 1, threads: int = 2) -> None:
    """Run a bench `runs` times with everything libraries print sent to stderr, then print its report with the
    machine it ran on (CPU, cores, memory, memcpy bandwidth with 1 and `threads` threads, load)."""
    from hpcft.bench import machine
    from hpcft.bench.harness import emit, stdout_to_stderr

    with stdout_to_stderr():
        where = machine.describe(threads)
        reports = [bench() for _ in range(runs)]
    emit(reports, as_json, where)


def _counts(text: str, what: str, option: str, example: str) -> tuple[int, ...]:
    """A comma-separated list of counts, each at least 1; BadParameter naming `option` otherwise."""
    try:
        counts = tuple(int(a) for a in text.split(",") if a.strip())
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a list of {what} counts; write e.g. {example}",
                                 param_hint=option) from None
    if not counts or min(counts) < 1:
        raise click.BadParameter(f"give at least one {what} count, each at least 1 (e.g. {example})", param_hint=option)
    return counts


DEVICE = click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
                      help="Where the model lives (cuda: a CUDA or ROCm GPU through torch.cuda).")


def _check_device(device: str) -> None:
    """UsageError where `device` is a GPU that torch does not see."""
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise click.UsageError("--device cuda: torch sees no CUDA/ROCm GPU here; use --device cpu")


@click.group()
def bench() -> None:
    """Benchmarks. With --json each prints one JSON object on stdout and the table on stderr."""


@bench.command()
@common_options
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
def snapshot(params: int, warmup: int, threads: int, root: str | None, as_json: bool, runs: int, steps: int,
             block: int, device: str, batch: int | None, flush_every: int, baselines: bool) -> None:
    """Step-time overhead of checkpointing every step: hpcft vs torch.save vs dcp.async_save."""
    from hpcft.bench.snapshot import SnapshotOptions, run

    _check_device(device)
    opts = SnapshotOptions(params=params, steps=steps, warmup=warmup, block=block, threads=threads, root=root,
                           device=device, batch=batch, flush_every=flush_every, baselines=baselines)
    _run(as_json, lambda: run(opts), runs, threads)


@bench.command()
@common_options
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True,
              help="Measured restores per path.")
@DEVICE
def restore(params: int, warmup: int, threads: int, root: str | None, as_json: bool, runs: int, repeats: int,
            device: str) -> None:
    """Restore bandwidth of hpcft from shm vs dcp.load and torch.load from local disk (into a GPU with --device)."""
    from hpcft.bench.restore import RestoreOptions, run

    _check_device(device)
    opts = RestoreOptions(params=params, repeats=repeats, warmup=warmup, threads=threads, root=root, device=device)
    _run(as_json, lambda: run(opts), runs, threads)


@bench.command()
@common_options
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
@click.option("--nice", type=click.IntRange(0, 19), default=10, show_default=True, help="Agents' CPU priority increment.")
@click.option("--window", type=click.FloatRange(min=1), default=60.0, show_default=True,
              help="Seconds of training with the agents running freely (protection rate, CPU per GB, lag).")
@click.option("--scheme", "schemes", multiple=True, type=click.Choice(["xor", "partner", "rs"]),
              help="Schemes to measure (repeatable) [default: all].")
def protect(params: int, warmup: int, threads: int, root: str | None, as_json: bool, runs: int, state_bytes: int,
            steps: int,
            interval: float | None, rate: float | None, cpu_share: float | None, cpu_cores: float | None, nice: int,
            window: float, schemes: tuple[str, ...]) -> None:
    """Cross-node protection per scheme: encode vs memcpy, bytes sent/stored vs state, rebuild time, step overhead."""
    from hpcft.agent.transport.throttle import CPU_SHARE
    from hpcft.bench.protect import ProtectOptions, run
    from hpcft.launch.config import profiles

    if cpu_share is not None and cpu_cores is not None:
        raise click.UsageError("give --cpu-share or --cpu-cores, not both")
    if cpu_share is None and cpu_cores is None:  # the bench trains on the CPU: the cap hpcft run gives such agents
        cpu_cores = profiles.CPU.agent_cpu_cores
    opts = ProtectOptions(params=params, state_bytes=state_bytes, steps=steps, warmup=warmup, threads=threads,
                          interval=interval, rate=rate, cpu_share=CPU_SHARE if cpu_share is None else cpu_share,
                          cpu_cores=cpu_cores, nice=nice, window=window, schemes=schemes, root=root)
    _run(as_json, lambda: run(opts), runs, threads)


@bench.command()
@click.option("--agents", default="16,64,256", show_default=True,
              help="Comma-separated agent counts N to measure, each a run of N agent processes on loopback.")
@click.option("--group", type=click.IntRange(min=2), default=4, show_default=True,
              help="Protection set size (xor): the bulk peers each agent connects to besides the overlay.")
@click.option("--rounds", type=click.IntRange(min=1), default=10, show_default=True,
              help="Agreement rounds measured per N.")
@click.option("--window", type=click.FloatRange(min=0.5), default=5.0, show_default=True,
              help="Seconds of heartbeats alone over which their traffic is measured.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout; the table goes to stderr.")
@RUNS
def scale(agents: str, group: int, rounds: int, window: float, as_json: bool, runs: int) -> None:
    """The agents' fabric at scale: N real agent processes on this machine; mesh setup, agreement latency,
    heartbeat traffic and sockets per agent, and their growth with N."""
    from hpcft.bench.scale import ScaleOptions, run

    opts = ScaleOptions(agents=_counts(agents, "agent", "--agents", "16,64,256"), group=group, rounds=rounds,
                        window=window)
    _run(as_json, lambda: run(opts), runs)


@bench.command()
@click.option("--state-bytes", type=Count(), default="64M", show_default=True, help="Snapshot bytes per node.")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="Launches per scheme and transport (medians reported).")
@click.option("--schemes", default="xor,partner,rs", show_default=True, help="Comma-separated schemes.")
@click.option("--transports", default="tcp,mpi", show_default=True, help="Comma-separated transports.")
@click.option("--root", default=None, help="Directory for the nodes' stores (default /dev/shm).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout; the table goes to stderr.")
@RUNS
def transport(state_bytes: int, repeats: int, schemes: str, transports: str, root: str | None, as_json: bool,
              runs: int) -> None:
    """The agents' transports side by side (TCP processes vs MPI ranks under mpirun): protect pass and rebuild."""
    from hpcft.bench.transport import TransportOptions, run

    opts = TransportOptions(state_bytes=state_bytes, repeats=repeats, root=root,
                            schemes=tuple(x.strip() for x in schemes.split(",") if x.strip()),
                            transports=tuple(x.strip() for x in transports.split(",") if x.strip()))
    _run(as_json, lambda: run(opts), runs)


@bench.command()
@click.option("--nodes", default="1000,4000,9408", show_default=True,
              help="Comma-separated node counts N, each N connections reporting once a second.")
@click.option("--seconds", type=click.FloatRange(min=1.0), default=10.0, show_default=True,
              help="Seconds of steady reports measured per N.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout; the table goes to stderr.")
@RUNS
def reports(nodes: str, seconds: float, as_json: bool, runs: int) -> None:
    """The supervisor's report service at a machine's size: N nodes' steady reports (status delta and 8 ranks'
    progress, once a second each) into one supervisor; its CPU, the reports received, the bounded log."""
    from hpcft.bench.reports import ReportsOptions, run

    _run(as_json, lambda: run(ReportsOptions(nodes=_counts(nodes, "node", "--nodes", "1000,9408"), seconds=seconds)),
         runs)


@bench.command()
@click.option("--dir", "directory", type=click.Path(file_okay=False), default=None,
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
              help="Baselines to run (repeatable) [default: both]: torch.save every step, then srun again in the "
                   "same allocation (relaunch) or scontrol requeue (requeue), and torch.load.")
@click.option("--crash", type=click.Choice(["kill", "silent"]), default="kill", show_default=True,
              help="The node crash: its processes killed (their connections close at once, which peers notice at "
                   "once), or silent (frozen: no connection closes, nothing answers, as after a power loss), "
                   "powered off once the supervisor decided.")
@click.option("--reference", type=click.Path(file_okay=False), default=None,
              help="The output directory of a finished fault-free run of the same job (--steps, --width, --layers; "
                   "its final.pt) to compare the faulted runs with, instead of making one first.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout; the table goes to stderr.")
@RUNS
def recovery(directory: str | None, steps: int, fault_at: int, step_delay: float, width: int, layers: int,
             poll_interval: float, keep: str | None, baselines: tuple[str, ...], crash: str, reference: str | None,
             as_json: bool, runs: int) -> None:
    """Fault → first step after it, in the sandbox: rank kill, node crash, batch host, and what a user does
    without hpcft (torch.save, relaunch in the allocation or requeue, torch.load)."""
    from hpcft.bench.recovery import RecoveryOptions, run
    from hpcft.bench.recovery_baselines import NAMES

    if keep and runs > 1:
        raise click.UsageError("--keep keeps one run's output: give it with --runs 1")
    opts = RecoveryOptions(dir=directory, steps=steps, fault_at=fault_at, step_delay=step_delay, width=width,
                           layers=layers, poll_interval=poll_interval, keep=keep, baselines=baselines or NAMES,
                           crash=crash, reference=reference)
    _run(as_json, lambda: run(opts), runs)
