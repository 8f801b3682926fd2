"""How docs/results.md writes a figure: one function per unit, the same text for the same value on every machine, and
the spread of repeated runs (`--runs N`: `spread[key]` = [min, max]) beside the median it belongs to."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

MISSING = "–"


def num(value: Any, unit: str = "") -> str:
    """`value` in `unit`: % (a signed fraction), share (a fraction), x (a ratio), s (ms below 1 s), GB/s, B, or none."""
    if value is None:
        return MISSING
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, str):
        return value
    if unit == "%":
        return f"{100 * value:+.1f} %"
    if unit == "share":
        return f"{100 * value:.1f} %"
    if unit == "x":
        return f"{value:.2f}×" if abs(value) < 100 else f"{value:.0f}×"
    if unit == "s":
        return f"{_g(value * 1e3)} ms" if abs(value) < 1 else f"{_g(value)} s"
    if unit == "B":
        return _bytes(value)
    if unit:
        return f"{_g(value)} {unit}"
    return f"{value:,}" if isinstance(value, int) else _g(value)


def _g(value: float) -> str:
    """Three significant digits; from 100 up the whole number (1,000, never 1e+03)."""
    return f"{value:,.0f}" if abs(value) >= 99.95 else f"{value:.3g}"


def _bytes(value: float) -> str:
    for scale, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if abs(value) >= scale:
            return f"{_g(value / scale)} {name}"
    return f"{value:.0f} B"


def cell(data: dict[str, Any], key: str, unit: str = "") -> str:
    """`data[key]` in `unit`, followed by its spread over repeated runs where the data has one."""
    text = num(data.get(key), unit)
    spread = (data.get("spread") or {}).get(key)
    if spread and data.get(key) is not None and spread[0] != spread[1]:
        text += f" [{num(spread[0], unit)}, {num(spread[1], unit)}]"
    return text


def table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A Markdown table: the header, its rule, one line per row."""
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in rows)]


def machine(data: dict[str, Any]) -> str:
    """The machine block of a report (hpcft/bench/machine.py) in one sentence."""
    m = data.get("machine")
    if not m:
        return "not recorded"
    gbps: dict[str, Any] = {}  # threads -> GB/s, the first key of each count (1 thread: _1_thread, _1_threads)
    for key, value in m.items():
        if key.startswith("memcpy_gbps_"):
            gbps.setdefault(key.split("_")[2], value)
    copies = ", ".join(f"{v} GB/s with {n} thread{'s' * (n != '1')}" for n, v in sorted(gbps.items(), key=_count))
    load = " ".join(str(x) for x in m.get("load_average", []))
    return (f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores ({m.get('usable_cores', '?')} usable), "
            f"{m.get('memory_gib', '?')} GiB; memcpy {copies or '?'}; load average {load}")


def _count(item: tuple[str, Any]) -> int:
    return int(item[0]) if item[0].isdecimal() else 0


def provenance(data: dict[str, Any], default: str) -> list[str]:
    """Where a saved result came from: its command line (or how to make one), its machine, when, how many runs."""
    runs = f"; median of {data['repeats']} runs, [min, max] beside each figure" if data.get("repeats") else ""
    when = f", {data['measured_at']}" if data.get("measured_at") else ""
    command = f"`{data['command']}`" if data.get("command") else f"`{default}` (not recorded: the usual form)"
    return [f"Command: {command}{runs}.  ", f"Machine: {machine(data)}{when}."]
