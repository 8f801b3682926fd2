"""A run's timeline as a PNG: the step every rank had completed against wall time (the progress history), each
incident a solid line and its recovery a shaded span, each fault event a dashed line, extra marks (the chaos tool's
injected faults) dotted; below, each incident's recovery time and steps lost. matplotlib (the `plots` extra) through
its Agg canvas: no display, and no change to a caller's pyplot backend."""
from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from hpcft import deps
from hpcft.errors import MissingDependencyError
from hpcft.report import summary as summaries
from hpcft.report.summary import Mark, Summary

PNG = "timeline.png"  # in the job directory, unless told otherwise
PURPOSE = "hpcft report's timeline"
COLOURS = {"node": "tab:red", "task": "tab:orange", "hang": "tab:purple", "walltime": "tab:brown",
           "agents": "tab:olive", "straggler": "tab:gray", "inprocess": "tab:cyan", "reshape": "tab:green",
           "stop": "black", "injected": "tab:pink"}


def draw(job_dir: str | os.PathLike, png: str | os.PathLike | None = None,
         marks: Iterable[Mark | tuple[float, str, str]] = (), summary: Summary | None = None) -> Path:
    """Draw `job_dir`'s timeline into `png` (default <job_dir>/timeline.png) with `marks` (time, label, kind) added;
    the file's path. MissingDependencyError without matplotlib (`pip install 'hpcft[plots]'`)."""
    deps.require("matplotlib", PURPOSE)
    from matplotlib.figure import Figure  # the Agg canvas by default: no display, pyplot's state untouched

    run = summary if summary is not None else summaries.read(job_dir)
    extra = [m if isinstance(m, Mark) else Mark(*m) for m in marks]
    zero = run.start if run.start is not None else min([t for t, _ in run.history] + [m.time for m in extra],
                                                       default=0.0)
    fig = Figure(figsize=(11, 6.5), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    if run.history:
        xs, ys = [t - zero for t, _ in run.history], [s for _, s in run.history]
        top.plot(xs, ys, ".", color="tab:blue", ms=3)  # the points; the step holds until the next, or the end
        if run.end is not None and run.end - zero > xs[-1]:
            xs, ys = xs + [run.end - zero], ys + ys[-1:]
        top.step(xs, ys, where="post", color="tab:blue", lw=1.5, label="step (every rank)")
    lines = sorted([(m, "--", 0.8) for m in run.marks] + [(m, ":", 1.2) for m in extra]
                   + [(i.mark, "-", 1.2) for i in run.incidents], key=lambda line: line[0].time)
    span = max([m.time for m, _, _ in lines] + [run.end or zero], default=zero) - zero
    placed: list[float] = []  # the labels' places so far: a label near another is written lower
    for mark, style, width in lines:
        _line(top, mark, zero, style, width, placed, gap=0.03 * span)
    for i in run.incidents:
        if i.recovered_at is not None:
            top.axvspan(i.mark.time - zero, i.recovered_at - zero, color=_colour(i.mark.kind), alpha=0.12)
        _recovery(bottom, i, zero)
    kinds = sorted({m.kind for m, _, _ in lines})
    for kind in kinds:  # one legend entry per colour
        top.plot([], [], color=_colour(kind), label=kind)
    if run.history or kinds:
        top.legend(loc="lower right", fontsize=7)
    top.set_ylabel("step every rank has completed")
    top.set_title(_title(run), fontsize=10)
    top.set_xlim(left=min(0.0, top.get_xlim()[0]))
    bottom.set_ylabel("recovery (s)")
    bottom.set_xlabel("wall time since the run's start (s)")
    out = Path(png) if png is not None else Path(job_dir) / PNG
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def try_draw(job_dir: str | os.PathLike, png: str | os.PathLike | None = None, summary: Summary | None = None,
             marks: Iterable = ()) -> tuple[Path | None, str]:
    """`draw`, or nothing without matplotlib: (the PNG's path or None, the one line that says which)."""
    try:
        out = draw(job_dir, png, marks=marks, summary=summary)
    except MissingDependencyError:
        return None, f"timeline: not drawn without matplotlib; {deps.hint('matplotlib')} for the plot"
    return out, f"timeline: {out}"


def _colour(kind: str) -> str:
    return COLOURS.get(kind, "tab:gray")


def _line(ax, mark: Mark, zero: float, style: str, width: float, placed: list[float], gap: float) -> None:
    """A vertical line at `mark`, its label written up it from the top, or a third lower for each label within `gap`
    of it already `placed` (three heights in turn)."""
    x = mark.time - zero
    near = sum(abs(x - p) < gap for p in placed)
    placed.append(x)
    ax.axvline(x, color=_colour(mark.kind), ls=style, lw=width)
    ax.text(x, 0.98 - 0.32 * (near % 3), f" {mark.label}", rotation=90, va="top", ha="right", fontsize=6,
            color=_colour(mark.kind), transform=ax.get_xaxis_transform())


def _recovery(ax, incident: summaries.Incident, zero: float) -> None:
    """The incident's bar below: its recovery time, with the steps it lost."""
    seconds = incident.recovery_s
    x = incident.mark.time - zero
    ax.bar(x, seconds or 0.0, width=max(seconds or 0.0, 0.5), align="edge", color=_colour(incident.mark.kind),
           alpha=0.7)
    said = "not recovered" if seconds is None else f"{seconds:.1f} s"
    ax.annotate(f"{said}, {incident.steps_lost} lost", (x, seconds or 0.0), fontsize=6, xytext=(0, 2),
                textcoords="offset points")


def _title(run: Summary) -> str:
    """The job, what it reached and how fast against its best pace (measured: summary.Summary's rates)."""
    head = f"job {run.job}: step {run.steps if run.steps is not None else '?'} in {run.wall_s:.0f} s"
    head += f", {len(run.incidents)} incident(s), {run.steps_lost} step(s) lost"
    if run.rate is None or run.best_rate is None:
        return head
    return (f"{head}\n{run.rate:.3g} steps/s over the wall time vs {run.best_rate:.3g} at best "
            f"(fastest stretch between incidents): {100 * (run.goodput or 0):.0f} %")
