"""`hpcft report JOB_DIR [--png PATH] [--json]`: parse, read the job directory, print, draw."""
from __future__ import annotations

import json
import time
from pathlib import Path

import click

from hpcft.report import summary as summaries, timeline
from hpcft.report.summary import Summary


def text(run: Summary) -> list[str]:
    """The summary in lines: the run, each incident and fault with its time since the start, each run's summary."""
    zero = run.start or 0.0
    began = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(zero)) if run.start is not None else "?"
    lines = [f"job {run.job} ({run.job_dir}): started {began}, {run.runs} run(s), {run.wall_s:.1f} s of wall time, "
             f"step {run.steps if run.steps is not None else '?'} reached (from step {run.first_step}), "
             f"{run.steps_lost} step(s) lost"]
    if run.rate is not None and run.best_rate is not None:
        lines.append(f"pace: {run.rate:.3g} steps/s over the wall time, {run.best_rate:.3g} at best (the fastest "
                     f"stretch between incidents): {100 * (run.goodput or 0):.0f} %")
    said = [(i.mark.time, i.line()) for i in run.incidents] + [(m.time, m.label) for m in run.marks]
    lines += ["faults and decisions:"] + [f"  +{t - zero:8.1f} s  {what}" for t, what in sorted(said)] if said else \
        ["faults and decisions: none"]
    for fields in run.summaries:
        lines.append("summary: " + " ".join(f"{k}={json.dumps(v) if isinstance(v, str) and ' ' in v else v}"
                                            for k, v in fields.items() if v not in ("", None)))
    return lines


@click.command()
@click.argument("job_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--png", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Where to draw the timeline (default JOB_DIR/timeline.png).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object on stdout; the text goes to stderr.")
def report(job_dir: Path, png: Path | None, as_json: bool) -> None:
    """Print a run's summary from its job directory and draw its timeline (PNG): steps against wall time, each fault
    and decision marked. Each recovery's time and the steps lost are annotated; without matplotlib the summary is
    printed all the same."""
    run = summaries.read(job_dir)
    drawn, line = timeline.try_draw(job_dir, png, summary=run)
    click.echo("\n".join([*text(run), line]), err=as_json)
    if as_json:
        click.echo(json.dumps({**run.as_dict(), "png": None if drawn is None else str(drawn),
                               **({} if drawn else {"png_missing": line})}))
