"""The chaos section of docs/results.md: any number of saved `hpcft chaos --json` objects (one per MTBF and seed),
goodput against MTBF as medians over seeds with their range, and recovery per fault kind over every fault."""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from hpcft.bench.page_format import MISSING, machine, num, table

TITLE = "Chaos: goodput under random faults (`hpcft chaos`)"
WHAT = ("`hpcft chaos` trains the recovery bench's job in the Slurm sandbox while faults of every kind arrive at "
        "random (a Poisson process of mean interval MTBF), and records each fault's recovery time and the steps it "
        "cost; goodput is the share of the wall time that became training in the final model. The baseline's goodput "
        "is a model: torch.save every k steps (Young's interval), replayed under the same fault arrivals with the "
        "save and restart times measured in the run.")
REQUEUES = ("Slurm's wait is the time from each requeue hpcft asked for (a walltime warning, a node lost with no "
            "spare left, a janitor's for a lost batch host) to the requeued run's start, summed: the last run's end on "
            "every node, the begin time hpcft gives the requeued job (5 s on; runs measured before 2026-12-07 waited "
            "out Slurm's requeue hold, `cred_expire`: 10 s in the sandbox, 120 s by default, as a run that ends later "
            "still does), its wait for nodes, and the requeued run's start (the notes below say what of it is not "
            "Slurm's). No rank trains meanwhile; no recovery inside the allocation shortens it. "
            "\"Less Slurm's wait\" is goodput over the time the job held nodes, as the baseline's model counts it "
            "(every fault a relaunch in the same allocation).")
COMMAND = "hpcft chaos --json --mtbf 60 --faults 100 --seed N > docs/results/data/chaos-mtbf60-seedN.json"


def by_mtbf(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per MTBF (ascending): the seeds, and goodput's and the baseline's median, min and max over them."""
    out = []
    for mtbf in sorted({r["mtbf_s"] for r in runs}):
        group = [r for r in runs if r["mtbf_s"] == mtbf]
        row: dict[str, Any] = {"mtbf_s": mtbf, "seeds": sorted(r.get("seed") for r in group)}
        for key, got in (("goodput", [r.get("goodput") for r in group]),
                         ("goodput_allocation", [in_allocation(r) for r in group]),
                         ("goodput_baseline", [r.get("goodput_baseline") for r in group])):
            values = [v for v in got if v is not None]
            row[key] = (statistics.median(values), min(values), max(values)) if values else None
        out.append(row)
    return out


def in_allocation(r: dict[str, Any]) -> float | None:
    """Goodput over the wall time less Slurm's wait after requeues (`requeue_wait_s`): the time the job held nodes,
    as the baseline's model counts it (every fault a relaunch in the same allocation); None if not saved."""
    wait, wall, goodput = r.get("requeue_wait_s"), r.get("wall_s"), r.get("goodput")
    if wait is None or not wall or goodput is None or wall <= wait:
        return None
    return goodput * wall / (wall - wait)


def by_kind(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per fault kind over every saved run's faults: count, survived, recovery seconds and steps lost (all values)."""
    kinds: dict[str, dict[str, Any]] = {}
    for r in runs:
        for f in (f for f in r.get("faults") or [] if not f.get("skipped")):
            k = kinds.setdefault(f["kind"], {"count": 0, "survived": 0, "recovery_s": [], "steps_lost": []})
            k["count"] += 1
            k["survived"] += bool(f.get("survived"))
            for key in ("recovery_s", "steps_lost"):
                if f.get(key) is not None:
                    k[key].append(f[key])
    return dict(sorted(kinds.items()))


def _range(value: tuple[float, float, float] | None, unit: str = "") -> str:
    if value is None:
        return MISSING
    median, low, high = value
    return num(median, unit) if low == high else f"{num(median, unit)} [{num(low, unit)}, {num(high, unit)}]"


def _median_max(values: list[float], unit: str = "") -> tuple[str, str]:
    return (num(statistics.median(values), unit), num(max(values), unit)) if values else (MISSING, MISSING)


def section(runs: Sequence[dict[str, Any]], images: list[str]) -> list[str]:
    """The chaos section's Markdown: what it measures, then the tables (or how to make the data)."""
    lines = [f"## {TITLE}", "", WHAT, ""]
    if not runs:
        return lines + ["No chaos run is saved yet. Make one per MTBF and seed, then regenerate this page:", "",
                        f"    {COMMAND}", "    hpcft bench page", ""]
    lines += table(["MTBF", "seeds", "goodput, hpcft", "hpcft, less Slurm's wait", "goodput, baseline (model)"],
                   [[num(g["mtbf_s"], "s"), ", ".join(str(s) for s in g["seeds"]), _range(g["goodput"], "share"),
                     _range(g["goodput_allocation"], "share"), _range(g["goodput_baseline"], "share")]
                    for g in by_mtbf(runs)])
    lines += ["", "Per fault kind, over every saved run's faults:", ""]
    rows = []
    for kind, k in by_kind(runs).items():
        rows.append([f"`{kind}`", num(k["count"]), num(k["survived"]), *_median_max(k["recovery_s"], "s"),
                     *_median_max(k["steps_lost"])])
    lines += table(["fault kind", "faults", "survived", "recovery, median", "recovery, max", "steps lost, median",
                    "steps lost, max"], rows) + [""]
    lines += table(["run", "faults injected / survived", "steps", "wall", "step", "requeues: Slurm's wait",
                    "baseline: save / every / restart", "final state equal"],
                   [[f"MTBF {num(r['mtbf_s'], 's')}, seed {r.get('seed')}",
                     f"{r.get('faults_injected')} / {r.get('faults_survived')}", num(r.get("steps")),
                     num(r.get("wall_s"), "s"), num(r.get("step_s"), "s"), _requeues(r),
                     _baseline(r.get("baseline") or {}), _final(r)] for r in sorted(runs, key=_order)])
    lines += ["", REQUEUES]
    lines += ["", *(f"![{alt}]({path})" for path, alt in _pairs(images)), *([""] if images else [])]
    commands = sorted({r["command"] for r in runs if r.get("command")})
    machines = sorted({machine(r) for r in runs if r.get("machine")})
    lines += [f"Command: `{c}`.  " for c in commands] or [f"Command: `{COMMAND}` (the usual form).  "]
    return lines + [f"Machine: {m}.  " for m in machines] + [""]


def _pairs(images: list[str]) -> list[tuple[str, str]]:
    return [(path, ALT[path.rsplit("/", 1)[-1]]) for path in images]


def _requeues(r: dict[str, Any]) -> str:
    wait, wall = r.get("requeue_wait_s"), r.get("wall_s")
    if wait is None or not wall:
        return num(r.get("requeues"))
    return f"{num(r.get('requeues'))}: {num(wait, 's')} ({num(wait / wall, 'share')} of the wall)"


def _baseline(b: dict[str, Any]) -> str:
    every = b.get("interval_steps")
    return f"{num(b.get('save_s'), 's')} / {num(every)} step{'s' * (every != 1)} / {num(b.get('restart_s'), 's')}"


def _final(r: dict[str, Any]) -> str:
    return "no (the run did not finish)" if r.get("completed") is False else num(r.get("final_equal"))


def _order(r: dict[str, Any]) -> tuple[float, int]:
    return r["mtbf_s"], r.get("seed") or 0


def shown(runs: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The run whose timeline the page draws: of those saved with their progress curve, the lowest seed at the
    largest MTBF (the headline's setting); None when none has one."""
    drawn = [r for r in runs if r.get("curve")]
    return min(drawn, key=lambda r: (-r["mtbf_s"], r.get("seed") or 0)) if drawn else None


def images(runs: Sequence[dict[str, Any]]) -> list[str]:
    """The chaos section's PNGs (ALT's names): none without a saved run, the timeline only when a run has a curve."""
    if not runs:
        return []
    return [name for name in ALT if name != TIMELINE or shown(runs) is not None]


TIMELINE = "chaos-timeline.png"
ALT = {TIMELINE: "one chaos run: the step every rank had completed against wall time, each injected fault a line "
                 "coloured by kind",
       "chaos-goodput.png": "goodput against MTBF, hpcft and the baseline: median over seeds, bars from min to max",
       "chaos-recovery.png": "recovery time per fault kind over every fault: box from quartiles, whiskers min to max"}
