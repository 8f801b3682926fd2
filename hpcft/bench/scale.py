"""`hpcft bench scale` (docs/results.md): N real agent processes (`hpcft.bench.scale_agent`), each on a loopback
address of its own as if on its own node, meshed as `hpcft run` meshes them; per N their setup, agreement latency,
heartbeat traffic and sockets, and the growth of each with N. Wall times are this box's (N agents share its cores);
per-agent CPU is what a machine with one agent per node pays."""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcft.agent.transport import secret as job_secret
from hpcft.agent.transport.mesh import overlay
from hpcft.agent.transport.rendezvous import Directory
from hpcft.bench.harness import Report
from hpcft.errors import HpcftError

FRONTIER_NODES = 9408


@dataclass(frozen=True)
class ScaleOptions:
    agents: tuple[int, ...] = (16, 64, 256)
    group: int = 4
    rounds: int = 10
    window: float = 5.0
    timeout: float = 300.0


def loopback(slot: int) -> str:
    """Agent `slot`'s own address: 127.1.0.1, 127.1.0.2, …, 127.1.1.0, … (all of 127/8 is this machine)."""
    n = slot + 1
    return f"127.{1 + n // 65536}.{n // 256 % 256}.{n % 256}"


def _spawn(n: int, opts: ScaleOptions, directory: str, secret: Path) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-m", "hpcft.bench.scale_agent", json.dumps(dict(
                                 slot=i, slots=n, host=loopback(i), directory=directory, secret=str(secret),
                                 group=opts.group, rounds=opts.rounds, window=opts.window, timeout=opts.timeout))],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "HPCFT_EVENT_DIR": str(secret.parent)}) for i in range(n)]


def _line(proc: subprocess.Popen, slot: int, what: str) -> str:
    line = proc.stdout.readline()
    if not line:
        raise HpcftError(f"bench agent {slot} ended before {what} (exit {proc.wait()}): {proc.stderr.read()[-2000:]}")
    return line


def measure(n: int, opts: ScaleOptions) -> dict[str, Any]:
    """One N: start the agents, wait until each is imported, release them at once, collect what each measured."""
    with tempfile.TemporaryDirectory(prefix="hpcft-scale-") as tmp:
        secret = job_secret.create(tmp)
        served = Directory(job_secret.load(str(secret)), host="127.0.0.1", bind="127.0.0.1")
        procs = _spawn(n, opts, served.address, secret)
        try:
            for i, p in enumerate(procs):
                _line(p, i, "it was ready")
            go = time.monotonic()
            for p in procs:
                p.stdin.write("go\n")
                p.stdin.flush()
            got = [json.loads(_line(p, i, "its report")) for i, p in enumerate(procs)]
            for p in procs:
                p.wait(timeout=opts.timeout)
        finally:
            for p in procs:  # a no-op for those already waited for
                p.kill()
                p.wait()
            served.close()
    return summarize(n, go, got, opts.group)


def summarize(n: int, go: float, got: Sequence[dict[str, Any]], group: int) -> dict[str, Any]:
    """One N's figures from the agents' reports (pure)."""
    rounds = len(got[0]["agree_s"])

    def slowest(key: str) -> float:  # per round the slowest agent's time; the median over the rounds, in ms
        return round(1e3 * statistics.median(max(g[key][r] for g in got) for r in range(rounds)), 3)

    def cpu(key: str) -> float:  # the median agent's CPU per round, in ms
        return round(1e3 * statistics.median(c for g in got for c in g[key]), 4)

    tx = [g["beat_tx_Bps"] for g in got if g["beat_tx_Bps"] is not None]
    return {
        "agents": n,
        "setup_s": round(max(g["formed"] for g in got) - go, 4),
        "setup_cpu_ms": round(1e3 * statistics.median(g["setup_cpu_s"] for g in got), 3),
        "agree_ms": slowest("agree_s"),
        "agree_cpu_ms": cpu("agree_cpu_s"),
        "gather_ms": slowest("gather_s"),
        "gather_cpu_ms": cpu("gather_cpu_s"),
        "agree_bytes_per_agent": max(g["agree_bytes"] for g in got),
        "gather_bytes_per_agent": max(g["gather_bytes"] for g in got),
        "agree_hops": max(1, math.ceil(math.log2(n))) if n > 1 else 0,
        "sockets_per_agent": max(g["sockets"] for g in got),
        "connections_per_agent": max(g["data_peers"] + g["beat_peers"] for g in got),
        "set_peers": max(g["exchange_peers"] for g in got),
        "overlay_peers": max(len(overlay(s, n)) for s in range(n)),
        "beat_Bps_per_agent": round(statistics.median(tx), 1) if tx else None,
        "beat_Bps_max": round(max(tx), 1) if tx else None,
        "silent_named": sum(len(g["silent"]) for g in got),
        "rss_mb_per_agent": round(statistics.median(g["rss_mb"] for g in got), 1),
        "group": group,
    }


def growth(per_n: Sequence[dict[str, Any]], key: str) -> dict[str, Any] | None:
    """How `key` grows with N (pure): the power-law exponent of a log-log fit, the linear fit against log2 N
    (y = a + b·log2 N) and that fit's value at 9,408 nodes."""
    pts = [(p["agents"], p[key]) for p in per_n if p.get(key) is not None and p["agents"] > 1 and p[key] > 0]
    if len(pts) < 2:
        return None
    lx = [math.log2(x) for x, _ in pts]
    exponent = _slope([math.log(x) for x, _ in pts], [math.log(y) for _, y in pts])
    b = _slope(lx, [y for _, y in pts])
    a = statistics.fmean(y for _, y in pts) - b * statistics.fmean(lx)
    return {"exponent": round(exponent, 3), "per_log2n": round(b, 4), "at_0": round(a, 4),
            "at_9408_by_log2n": round(a + b * math.log2(FRONTIER_NODES), 3)}


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def frontier(group: int) -> dict[str, Any]:
    """What the fabric's structure gives at 9,408 nodes (counted, not measured): connections and hops per agent."""
    ring = len(overlay(0, FRONTIER_NODES))
    return {"nodes": FRONTIER_NODES, "agree_hops": math.ceil(math.log2(FRONTIER_NODES)), "overlay_peers": ring,
            "set_peers": group - 1, "connections_per_agent_at_most": (group - 1) + 2 * ring,
            "all_to_all_connections": FRONTIER_NODES - 1 + ring}


ROWS = (("setup_s", "s", "mesh setup (every agent connected)"),
        ("agree_ms", "ms", "one agreement, all-reduce (slowest agent)"), ("agree_cpu_ms", "ms", "its CPU per agent"),
        ("agree_bytes_per_agent", "B", "its bytes sent per agent"),
        ("gather_ms", "ms", "one all-gather (slowest agent)"), ("gather_cpu_ms", "ms", "its CPU per agent"),
        ("gather_bytes_per_agent", "B", "its bytes sent per agent"), ("sockets_per_agent", "", "sockets per agent"),
        ("connections_per_agent", "", "connections per agent (data + heartbeats)"),
        ("beat_Bps_per_agent", "B/s", "heartbeat bytes sent per agent"))
KEYS = ("setup_s", "setup_cpu_ms", *(key for key, _, _ in ROWS[1:]))


def run(opts: ScaleOptions) -> Report:
    """Every N of `opts.agents` in turn; a report of the per-N figures and their growth."""
    report = Report("scale")
    per_n = [measure(n, opts) for n in opts.agents]
    for p in per_n:
        n = p["agents"]
        for key, unit, label in ROWS:
            report.add(f"{key}_n{n}", p[key], unit, f"N={n:<5} {label}")
    report.note("agents", list(opts.agents))
    report.note("per_n", {str(p["agents"]): p for p in per_n})
    for key in KEYS:
        report.note(key, {str(p["agents"]): p[key] for p in per_n})
    report.note("growth", {k: growth(per_n, k) for k in KEYS})
    report.note("frontier", frontier(opts.group))
    report.note("options", {"group": opts.group, "rounds": opts.rounds, "window_s": opts.window})
    return report
