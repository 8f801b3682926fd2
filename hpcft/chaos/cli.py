"""`hpcft chaos`: parse, run, print (the JSON object on stdout with --json, the story on stderr)."""
from __future__ import annotations

import json
import signal
import sys
from dataclasses import fields

import click

from hpcft.chaos.schedule import KINDS

_HELP = {
    "mtbf": "Mean seconds between faults (a Poisson process).",
    "faults": "About how many faults: sizes the run; faults keep coming until the job ends.",
    "mix": "Fault kinds and weights: kind=w,…, all (each kind alike), or field (Llama 3's interruptions). "
           "Kinds: " + ", ".join(KINDS) + ".",
    "seed": "Seed of the fault schedule (printed; the same seed repeats the run's faults).",
    "repair_s": "Seconds after which a crashed node is powered on again and resumed.",
    "steps": "Training steps (0: --faults × --mtbf of training at the step time of a short fault-free run).",
    "step_delay": "Seconds of sleep after each step (what a step's compute takes on a real machine).",
    "width": "Model width (layers of width² parameters, AdamW).", "layers": "Model depth.",
    "spares": "Spare nodes beside the 4 active ones.", "persist_every": "Durable flush every N protected steps.",
    "hang_timeout": "Seconds without a step before a rank counts as hung.",
    "dir": "A running sandbox to use (default: start one, stop it after).",
    "keep": "Keep the runs here (a new or empty directory).",
    "reference": "The output directory of a fault-free run of the same steps, width and layers.",
}


def _options(func):
    from hpcft.chaos.run import ChaosOptions
    for f in reversed(fields(ChaosOptions)):
        name = "--" + f.name.replace("_", "-")
        kind = {int: int, float: float}.get(type(f.default), str)
        func = click.option(name, f.name, type=kind, default=f.default, show_default=f.default is not None,
                            help=_HELP[f.name])(func)
    return func


@click.command()
@_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout (the story goes to stderr).")
def chaos(as_json: bool, **opts) -> None:
    """Train under hpcft while faults of every kind arrive at a mean interval; report goodput against a torch.save
    baseline.

    The bench job (hpcft/bench/train_job.py) is submitted with `hpcft submit` into the sandbox, so that it is requeued
    when the spares run out; crashed nodes come back after --repair-s. The fault schedule is seeded and printed."""
    from hpcft.chaos.run import ChaosOptions, run

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: the run's jobs cancelled, its sandbox stopped
    result = run(ChaosOptions(**opts), lambda line: click.echo(line, err=as_json))
    if as_json:
        click.echo(json.dumps(result))
    bad = result["faults_survived"] < result["faults_injected"] or not result["final_equal"]
    raise click.exceptions.Exit(1 if bad else 0)
