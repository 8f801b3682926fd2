"""`hpcft bench reports` (docs/results.md): N nodes' steady reports (8 ranks each, once a second) from a client
process into a real report service (the supervisor's Fabric) in this one; measured: reports received per second,
the supervisor's CPU per second and per report, the bounded log. `sent_hz` says what the client managed to send."""
from __future__ import annotations

import json
import multiprocessing as mp
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hpcft.agent.transport import secret as job_secret
from hpcft.agent.transport.tcp import connect
from hpcft.bench.harness import Report


@dataclass(frozen=True)
class ReportsOptions:
    nodes: tuple[int, ...] = (1000, 4000, 9408)
    ranks: int = 8  # per node (Frontier: one per GCD)
    seconds: float = 10.0  # of steady reports measured per N


def _full(slot: int, ranks: int, step: int) -> dict[str, Any]:
    """An agent's whole status (its first report), as agent.py `report` publishes it."""
    mine = [str(slot * ranks + r) for r in range(ranks)]
    return {"slot": slot, "tag": "0", "pid": 12345, "time": time.time(), "node": f"frontier{slot:05d}",
            "phase": "protecting", "scheme": "xor", "group": 4, "losses": 1, "distance": 1, "slots": 9408,
            "interval": 1.0, "staged": step, "protected": step - 1, "persisted": step - 50, "flushed_request": None,
            "flushing": False, "flush_error": None, "flush_phase": "idle", "local": None, "cpu_cores": 0.25,
            "addr": "10.128.0.1:40000", "ranks": dict.fromkeys(mine, step),
            "versions": dict.fromkeys(mine, [step - 1, step]), "staged_steps": [step - 1, step],
            "protected_steps": [step - 2, step - 1], "lag_steps": 1, "lag_s": 1.02, "snapshot_bytes": 64 << 30,
            "store_bytes": 192 << 30, "shm_free": 200 << 30, "mem_available": 300 << 30}


def _delta(slot: int, ranks: int, step: int) -> dict[str, Any]:
    """A steady-state round's report: what changes from one round to the next, and the ranks' new step."""
    mine = [str(slot * ranks + r) for r in range(ranks)]
    return {"tag": "0", "slot": slot, "node": f"frontier{slot:05d}",
            "set": {"time": time.time(), "staged": step, "protected": step - 1, "ranks": dict.fromkeys(mine, step),
                    "versions": dict.fromkeys(mine, [step - 1, step]), "staged_steps": [step - 1, step],
                    "protected_steps": [step - 2, step - 1], "store_bytes": (192 << 30) + step},
            "progress": {r: [step, 0.41] for r in mine}}


def _client(address: str, secret: bytes, nodes: int, ranks: int, seconds: float, out: Any) -> None:
    """N connections, a whole status over each, then one delta per connection per second for `seconds`."""
    host, port = address.split(",")[0].rsplit(":", 1)[0], int(address.rsplit(":", 1)[1])
    chans = [connect(secret, host, port, timeout=30.0) for _ in range(nodes)]
    for slot, ch in enumerate(chans):
        ch.send({"report": {"tag": "0", "slot": slot, "node": f"frontier{slot:05d}", "full": True,
                            "set": _full(slot, ranks, 100)}})
    out.put(("connected", time.time()))
    started, sent, size, step = time.monotonic(), 0, 0, 101
    while time.monotonic() - started < seconds:
        for slot, ch in enumerate(chans):
            due = started + (step - 101) + slot / nodes  # paced: N reports spread over each second
            if (wait := due - time.monotonic()) > 0:
                time.sleep(wait)
            msg = {"report": _delta(slot, ranks, step)}
            size += len(json.dumps(msg, separators=(",", ":")))
            ch.send(msg)
            sent += 1
        step += 1
    out.put(("done", sent, time.monotonic() - started, size / max(sent, 1)))
    time.sleep(1.0)
    for ch in chans:
        ch.close()


def measure(nodes: int, ranks: int, seconds: float) -> dict[str, Any]:
    """One N: the supervisor's figures while N nodes report once a second (see module doc)."""
    from hpcft.launch.fabric.service import Fabric

    with tempfile.TemporaryDirectory(prefix="hpcft-bench-reports-") as tmp:
        fabric = Fabric(Path(tmp), emit=lambda *a, **k: None)
        fabric.start(None)
        secret = job_secret.load(Path(tmp) / job_secret.NAME)
        out: Any = mp.get_context("spawn").Queue()
        proc = mp.get_context("spawn").Process(target=_client, args=(fabric.server.address, secret, nodes, ranks,
                                                                    seconds, out))
        proc.start()
        try:
            out.get(timeout=600)  # ("connected", time): every connection open
            while fabric.server.received < nodes:  # every whole status taken: the steady state begins
                time.sleep(0.05)
            cpu0, wall0, got0, writes0 = time.process_time(), time.monotonic(), fabric.server.received, fabric.writes
            _, sent, sent_s, avg = out.get(timeout=seconds + 600)
            deadline = time.monotonic() + 30
            while fabric.server.received < nodes + sent and time.monotonic() < deadline:
                time.sleep(0.05)
            cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
            got, writes = fabric.server.received - got0, fabric.writes - writes0
            connections = fabric.server.connections
        finally:
            proc.join(30)
            fabric.close()
            log_bytes = (Path(tmp) / "status.json").stat().st_size
    return {"nodes": nodes, "ranks_per_node": ranks, "connections": connections, "sent_hz": round(sent / sent_s, 1),
            "received_hz": round(got / wall, 1), "report_bytes": round(avg), "supervisor_cpu": round(cpu / wall, 3),
            "us_per_report": round(1e6 * cpu / max(got, 1), 1), "log_bytes": log_bytes,
            "log_writes_hz": round(writes / wall, 2), "seconds": round(wall, 2)}


def run(opts: ReportsOptions) -> Report:
    """Every N of `opts`, one after the other."""
    report = Report("reports")
    report.note("options", asdict(opts))
    for n in opts.nodes:
        r = measure(n, opts.ranks, opts.seconds)
        report.add(f"received_hz_{n}", r["received_hz"], "/s",
                   f"{n} nodes: reports received (sent {r['sent_hz']}/s, {r['report_bytes']} B each)")
        report.add(f"supervisor_cpu_{n}", r["supervisor_cpu"], "cores", f"{n} nodes: the supervisor's CPU")
        report.add(f"us_per_report_{n}", r["us_per_report"], "us", f"{n} nodes: CPU per report")
        report.add(f"log_bytes_{n}", r["log_bytes"], "B", f"{n} nodes: bounded log size")
        report.add(f"log_writes_hz_{n}", r["log_writes_hz"], "/s", f"{n} nodes: bounded log writes")
        report.note(f"result_{n}", r)
    return report
