"""The PNGs of docs/results.md, drawn with matplotlib (the `plots` extra) from the same saved JSON as its tables.
`IMAGES` names each bench's files without importing matplotlib, so the Markdown is the same with or without it; the
PNGs carry no date or software version, so the same data and matplotlib draw the same bytes."""
from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpcft import deps
from hpcft.bench import page_chaos
from hpcft.bench.page_sections import METHODS, recovery_rows, restart_s

Figure = Any  # matplotlib.figure.Figure, imported only to draw
IMAGES: dict[str, dict[str, str]] = {  # bench -> {file: alt text}
    "snapshot": {"snapshot-overhead.png": "step-time and CPU-time overhead of checkpointing every step, per method",
                 "snapshot-bandwidth.png": "hpcft's copy and the durable flush against memcpy and a plain write"},
    "restore": {"restore-bandwidth.png": "restore bandwidth per path: hpcft warm, relaunch, prefetched, dcp.load, "
                                         "torch.load, memcpy"},
    "protect": {"protect-schemes.png": "per scheme: encode ÷ memcpy, bytes stored and sent ÷ state, rebuild time"},
    "transport": {"transport.png": "protect pass and rebuild per scheme, TCP against MPI"},
    "recovery": {"recovery-phases.png": "fault → first step per fault kind and path, cut into phases"},
    "scale": {"scale.png": "the agents' fabric against N: setup, agreement, sockets and heartbeat bytes per agent"},
    "reports": {"reports.png": "the supervisor's CPU and CPU per report against the number of nodes"},
    "control": {},
    "chaos": page_chaos.ALT,
}
COLORS = {"hpcft": "#1f77b4", "baseline": "#d62728", "other": "#7f7f7f", "extra": "#2ca02c"}


def _bars(ax: Any, labels: list[str], values: list[float | None], colors: list[str], unit: str) -> None:
    """One bar per label (a missing value: no bar), its value written above it."""
    xs = range(len(labels))
    heights = [v if v is not None else 0.0 for v in values]
    ax.bar(xs, heights, color=colors)
    for x, v in zip(xs, values):
        if v is not None:
            ax.annotate(f"{v:.0f}{unit}" if abs(v) >= 100 else f"{v:.3g}{unit}", (x, v), ha="center", va="bottom",
                        fontsize=8)
    ax.set_xticks(list(xs), labels, fontsize=8, rotation=15)
    ax.axhline(0, color="black", linewidth=0.5)


def snapshot_overhead(fig: Figure, d: dict[str, Any]) -> None:
    ax = fig.subplots()
    names = [*METHODS.values(), *(["hpcft + flush"] if "overhead_hpcft_flush" in d else [])]
    keys = [*METHODS, *(["hpcft_flush"] if "overhead_hpcft_flush" in d else [])]
    wall = [d.get(f"overhead_{k}") for k in keys]
    _bars(ax, names, [100 * v if v is not None else None for v in wall],
          [COLORS["hpcft"] if k.startswith("hpcft") else COLORS["baseline"] for k in keys], " %")
    ax.set_ylabel("step-time overhead, every step (%)")
    ax.set_title("Checkpointing every step: overhead over a step without")


def snapshot_bandwidth(fig: Figure, d: dict[str, Any]) -> None:
    ax = fig.subplots()
    bars = [("hpcft copy\n(idle)", "copy_GBps", "hpcft"), ("hpcft copy\n(training)", "copy_GBps_in_training", "hpcft"),
            ("memcpy", "memcpy_GBps", "other"), ("flush", "flush_GBps", "extra"),
            ("plain write", "write_GBps", "other")]
    bars = [b for b in bars if b[1] in d]
    _bars(ax, [b[0] for b in bars], [d[b[1]] for b in bars], [COLORS[b[2]] for b in bars], "")
    ax.set_ylabel("GB/s")
    ax.set_title("Snapshot copy + crc32c and durable flush against plain copies")


def restore_bandwidth(fig: Figure, d: dict[str, Any]) -> None:
    ax = fig.subplots()
    nbytes = d.get("state_bytes") or 0
    paths = [("hpcft\nwarm", "restore_s_hpcft", "hpcft"), ("hpcft\nrelaunch", "restore_s_hpcft_cold", "hpcft"),
             ("hpcft\nprefetched", "restore_s_hpcft_prefetched", "hpcft"), ("dcp.load", "restore_s_dcp", "baseline"),
             ("torch.load", "restore_s_torch_load", "baseline")]
    values = [nbytes / d[k] / 1e9 if d.get(k) else None for _, k, _ in paths] + [d.get("memcpy_GBps")]
    _bars(ax, [p[0] for p in paths] + ["memcpy"], values, [COLORS[p[2]] for p in paths] + [COLORS["other"]], "")
    ax.set_ylabel("GB/s")
    ax.set_title("Restore bandwidth per path")


def protect_schemes(fig: Figure, d: dict[str, Any]) -> None:
    schemes = [r["scheme"] for r in d.get("schemes", [])]
    axes = fig.subplots(1, 3)
    for ax, (key, title, unit) in zip(axes, (("encode_vs_memcpy", "encode ÷ memcpy", "×"),
                                             ("stored_per_node_over_state", "stored per node ÷ state", "×"),
                                             ("rebuild_s", "rebuild of one node (s)", ""))):
        _bars(ax, schemes, [d.get(f"{s}_{key}") for s in schemes], [COLORS["hpcft"]] * len(schemes), unit)
        ax.set_title(title, fontsize=9)


def transport_bars(fig: Figure, d: dict[str, Any]) -> None:
    runs = d.get("runs") or []
    schemes = list(dict.fromkeys(r["scheme"] for r in runs))
    transports = list(dict.fromkeys(r["transport"] for r in runs))
    by = {(r["scheme"], r["transport"]): r for r in runs}
    axes = fig.subplots(1, 2)
    width = 0.8 / max(len(transports), 1)
    for ax, key in zip(axes, ("protect_s", "rebuild_s")):
        for i, t in enumerate(transports):
            xs = [j + i * width for j in range(len(schemes))]
            ax.bar(xs, [by.get((s, t), {}).get(key) or 0.0 for s in schemes], width, label=t.upper(),
                   color=(COLORS["hpcft"], COLORS["extra"])[i % 2])
        ax.set_xticks([j + width * (len(transports) - 1) / 2 for j in range(len(schemes))], schemes)
        ax.set_title("protect pass (s)" if key == "protect_s" else "rebuild of one node (s)", fontsize=9)
        ax.legend(fontsize=8)


def recovery_phases(fig: Figure, d: dict[str, Any]) -> None:
    ax = fig.subplots()
    rows = recovery_rows(d)
    phases = (("detection", lambda ph: ph.get("detection_s")), ("relaunch / restart", restart_s),
              ("restore", lambda ph: ph.get("restore_s")), ("first step", lambda ph: ph.get("first_step_s")))
    left = [0.0] * len(rows)
    for (name, get), color in zip(phases, ("#ff7f0e", "#1f77b4", "#2ca02c", "#9467bd")):
        widths = [get(ph) or 0.0 for _, _, ph in rows]
        ax.barh(range(len(rows)), widths, left=left, label=name, color=color)
        left = [a + b for a, b in zip(left, widths)]
    for y, (_, _, ph) in enumerate(rows):
        ax.annotate(f" {ph.get('total_s', 0):.2f} s", (left[y], y), va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [label.replace(" (", "\n(").replace(": ", ":\n") for _, label, _ in rows],
                  fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the fault")
    ax.set_title("Fault → first step after it")
    ax.set_xlim(0, max(left, default=0) * 1.15 or 1)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=4)


def scale_lines(fig: Figure, d: dict[str, Any]) -> None:
    per_n = d.get("per_n") or {}
    ns = sorted(int(n) for n in per_n)
    axes = fig.subplots(1, 4)
    for ax, (key, title) in zip(axes, (("setup_s", "mesh setup (s)"), ("agree_cpu_ms", "agreement CPU per agent (ms)"),
                                       ("sockets_per_agent", "sockets per agent"),
                                       ("beat_Bps_per_agent", "heartbeat B/s per agent"))):
        ax.plot(ns, [per_n[str(n)].get(key) for n in ns], marker="o", color=COLORS["hpcft"])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("agents N", fontsize=8)
        ax.set_title(title, fontsize=9)


def reports_lines(fig: Figure, d: dict[str, Any]) -> None:
    results = sorted((v for k, v in d.items() if k.startswith("result_")), key=lambda r: r["nodes"])
    ns = [r["nodes"] for r in results]
    axes = fig.subplots(1, 2)
    for ax, (key, title) in zip(axes, (("supervisor_cpu", "supervisor CPU (cores)"),
                                       ("us_per_report", "CPU per report (µs)"))):
        ax.plot(ns, [r.get(key) for r in results], marker="o", color=COLORS["hpcft"])
        ax.set_xlabel("nodes reporting once a second", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.set_ylim(bottom=0)


def chaos_goodput(fig: Figure, runs: list[dict[str, Any]]) -> None:
    ax = fig.subplots()
    groups = page_chaos.by_mtbf(runs)
    for key, label, color in (("goodput", "hpcft", COLORS["hpcft"]), ("goodput_baseline", "torch.save baseline (model)",
                                                                      COLORS["baseline"])):
        pts = [(g["mtbf_s"], *g[key]) for g in groups if g[key] is not None]
        ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[[p[1] - p[2] for p in pts],
                    [p[3] - p[1] for p in pts]], marker="o", capsize=3, label=label, color=color)
    ax.set_xscale("log")
    ax.set_xticks([g["mtbf_s"] for g in groups], [f"{g['mtbf_s']:g}" for g in groups])
    ax.minorticks_off()
    ax.set_xlabel("mean time between faults (s)")
    ax.set_ylabel("goodput")
    ax.set_ylim(0, 1.05)
    ax.legend()
    ax.set_title("Goodput against MTBF (median over seeds, min to max)")


def chaos_timeline(fig: Figure, runs: list[dict[str, Any]]) -> None:
    from matplotlib import colormaps

    ax = fig.subplots()
    run = page_chaos.shown(runs) or {}
    curve = run.get("curve") or []
    ax.plot([t for t, _ in curve], [s for _, s in curve], color="black", lw=1, label="step (every rank)")
    faults = [f for f in run.get("faults") or [] if not f.get("skipped")]
    palette = colormaps["tab20"]
    colours = {kind: palette(i % 20) for i, kind in enumerate(dict.fromkeys(f["kind"] for f in faults))}
    for f in faults:
        ax.axvline(f["t"], color=colours[f["kind"]], lw=0.7)
    for kind, colour in colours.items():
        ax.plot([], [], color=colour, label=kind)
    ax.legend(fontsize=6, ncol=2, loc="upper left")
    ax.set_xlabel("wall time since the first step (s)")
    ax.set_ylabel("step every rank has completed")
    ax.set_title(f"MTBF {run.get('mtbf_s', 0):g} s, seed {run.get('seed')}: {len(faults)} faults, goodput "
                 f"{run.get('goodput', 0):.3f}", fontsize=9)


def chaos_recovery(fig: Figure, runs: list[dict[str, Any]]) -> None:
    ax = fig.subplots()
    kinds = {k: v["recovery_s"] for k, v in page_chaos.by_kind(runs).items() if v["recovery_s"]}
    if kinds:
        ax.boxplot(list(kinds.values()), whis=(0, 100))
        ax.set_yscale("symlog", linthresh=0.1)
        ax.set_xticks(range(1, len(kinds) + 1), list(kinds), fontsize=8, rotation=30)
        for x, values in enumerate(kinds.values(), start=1):
            ax.annotate(f"{statistics.median(values):.2g} s", (x, max(values)), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("recovery (s, log above 0.1)")
    ax.set_title("Recovery per fault kind, every fault of every saved run")


DRAW: dict[str, Callable[[Figure, Any], None]] = {
    "snapshot-overhead.png": snapshot_overhead, "snapshot-bandwidth.png": snapshot_bandwidth,
    "restore-bandwidth.png": restore_bandwidth, "protect-schemes.png": protect_schemes,
    "transport.png": transport_bars, "recovery-phases.png": recovery_phases, "scale.png": scale_lines,
    "reports.png": reports_lines, "chaos-goodput.png": chaos_goodput, "chaos-recovery.png": chaos_recovery,
    page_chaos.TIMELINE: chaos_timeline}
WIDE = {"protect-schemes.png", "transport.png", "scale.png", "reports.png", "chaos-recovery.png", page_chaos.TIMELINE}


def draw(name: str, data: Any, path: Path) -> None:
    """Draw image `name` of IMAGES from `data` (a bench's object, or the list of chaos runs) into `path`."""
    deps.require("matplotlib", "hpcft bench page's plots")
    from matplotlib.figure import Figure as MplFigure

    fig = MplFigure(figsize=(11, 3.6) if name in WIDE else (7, 4), layout="constrained")
    DRAW[name](fig, data)
    fig.savefig(path, dpi=100, metadata={"Software": None})
