"""The tables of docs/results.md, one function per bench over its saved `--json` object (hpcft/bench/<name>.py says
what each key means); pure: the same JSON gives the same Markdown."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hpcft.bench.page_format import MISSING, cell, num, table

METHODS = {"hpcft": "hpcft", "torch_save": "torch.save", "dcp_async": "dcp.async_save"}


@dataclass(frozen=True)
class Section:
    """One bench's section: its heading, what it measures (two sentences), the command that makes its JSON, and the
    Markdown of its tables from that JSON."""

    name: str
    title: str
    what: str
    usual: str
    body: Callable[[dict[str, Any]], list[str]]


def snapshot(d: dict[str, Any]) -> list[str]:
    """Step-time overhead per method, then hpcft's copy and the durable flush against plain copies and writes."""
    flush = "overhead_hpcft_flush" in d
    head = ["every step", *METHODS.values()] + [f"hpcft, flush every {d.get('flush_every')}"] * flush
    rows = [["step-time overhead", *(cell(d, f"overhead_{k}", "%") for k in METHODS)]
            + [cell(d, "overhead_hpcft_flush", "%")] * flush,
            ["process CPU-time overhead", *(cell(d, f"cpu_overhead_{k}", "%") for k in METHODS)] + [MISSING] * flush,
            ["training thread blocked per call", cell(d, "blocked_s_per_snapshot", "s"),
             cell(d, "blocked_s_torch_save", "s"), cell(d, "blocked_s_dcp_async", "s")] + [MISSING] * flush]
    config = d.get("config") or {}
    out = table(head, rows) + [
        "", f"dcp.async_save's overhead ÷ hpcft's: **{cell(d, 'dcp_async_vs_hpcft_overhead', 'x')}** (target ≥ 5). "
        f"The step without checkpointing: {cell(d, 'step_s_none', 's')}; hpcft blocks the training thread for "
        f"{cell(d, 'blocked_fraction_hpcft', 'share')} of it (snapshot start {cell(d, 'start_s_per_snapshot', 's')}, "
        f"target ≤ 2 ms). Model: {num(d.get('params'))} parameters, {num(d.get('state_bytes'), 'B')} of state; "
        f"{config.get('steps', '?')} measured steps per method, in blocks of {config.get('block', '?')}.", ""]
    threads = d.get("copy_threads")
    rows = [["hpcft copy + crc32c, no training", cell(d, "copy_GBps", "GB/s"), cell(d, "copy_vs_memcpy", "x")],
            ["the same, during training", cell(d, "copy_GBps_in_training", "GB/s"),
             cell(d, "copy_vs_memcpy_in_training", "x")],
            [f"memcpy of the same bytes, {threads} threads", cell(d, "memcpy_GBps", "GB/s"), "1"]]
    if flush:
        rows += [["durable flush (verify, DCP records, fsync)", cell(d, "flush_GBps", "GB/s"),
                  f"{cell(d, 'flush_vs_write', 'x')} a plain write"],
                 ["plain write + fsync, same bytes", cell(d, "write_GBps", "GB/s"), MISSING]]
    return out + table(["copy", "bandwidth", "÷ memcpy (target ≥ 0.9)"], rows) + [
        "", f"Copy backend `{d.get('backend', '?')}`, checksums on the {d.get('checksums', '?')}."]


def restore(d: dict[str, Any]) -> list[str]:
    """Every restore path's time and bandwidth, against the memcpy of the same bytes."""
    nbytes, memcpy_gbps = d.get("state_bytes"), d.get("memcpy_GBps")
    memcpy_s = nbytes / memcpy_gbps / 1e9 if nbytes and memcpy_gbps else None

    def row(what: str, key: str, ratio: str = "", speedup: str = "") -> list[str]:
        s = d.get(key) if key else memcpy_s
        vs = cell(d, ratio, "x") if ratio else num(memcpy_s / s if memcpy_s and s else None, "x")
        return [what, num(s, "s") if key else num(memcpy_s, "s"),
                num(nbytes / s / 1e9 if nbytes and s else None, "GB/s"), vs, cell(d, speedup, "x") if speedup else ""]

    rows = [row("hpcft, warm (the process that saved it)", "restore_s_hpcft", "restore_vs_memcpy"),
            row("hpcft, a relaunch (open the store + restore)", "restore_s_hpcft_cold", "restore_vs_memcpy_cold",
                "speedup_vs_dcp_cold"),
            row("hpcft, a relaunch with the slot mapped ahead", "restore_s_hpcft_prefetched",
                "restore_vs_memcpy_prefetched"),
            row("dcp.load + set_state_dict", "restore_s_dcp", speedup="speedup_vs_dcp"),
            row("torch.load + load_state_dict", "restore_s_torch_load", speedup="speedup_vs_torch_load"),
            row(f"memcpy, {d.get('restore_threads', '?')} threads", "")]
    if "memcpy_shm_s" in d:
        rows += [row("memcpy out of the store's own mapping", "memcpy_shm_s"),
                 row("the same out of a fresh mapping", "memcpy_shm_fresh_s")]
    return table(["restore path", "time", "GB/s", "memcpy ÷ it", "its time ÷ hpcft's"], rows) + [
        "", f"hpcft warm ÷ memcpy out of the store's mapping: {cell(d, 'restore_vs_memcpy_shm', 'x')}; a relaunch's "
        f"÷ a fresh mapping's: {cell(d, 'restore_vs_memcpy_shm_cold', 'x')}. Targets: warm ≥ 0.9, relaunch ≥ 0.8, "
        f"≥ 4× dcp.load. {num(d.get('state_bytes'), 'B')} of model + AdamW state ({num(d.get('params'))} "
        f"parameters), every restore checked bit for bit: {num(d.get('verified'))}; store pages: "
        f"`{d.get('store_pages', '?')}`."]


def protect(d: dict[str, Any]) -> list[str]:
    """Per scheme: encode against memcpy, bytes against the formula, a rebuild, the step overhead, the lag."""
    rows = []
    for rec in d.get("schemes", []):
        s = rec["scheme"]
        rows.append([f"`{s}`", cell(d, f"{s}_encode_vs_memcpy", "x"),
                     f"{cell(d, f'{s}_stored_per_node_over_state', 'x')} ({num(rec.get('expected_over_state'), 'x')})",
                     f"{cell(d, f'{s}_sent_per_node_over_state', 'x')} "
                     f"({num(rec.get('expected_sent_over_state'), 'x')})",
                     cell(d, f"{s}_rebuild_s", "s"), cell(d, f"{s}_overhead_with_protection", "%"),
                     cell(d, f"{s}_overhead_from_agent_cpu", "%"), cell(d, f"{s}_agent_cpu_s_per_gb", "s"),
                     cell(d, f"{s}_protected_per_snapshot", "x"), cell(d, f"{s}_steps_at_risk_max")])
    config = d.get("config") or {}
    cap = f"{config['cpu_cores']} cores" if config.get("cpu_cores") is not None else \
        f"{config.get('cpu_share')} of the cores"
    return table(["scheme", "encode ÷ memcpy", "stored ÷ state (formula)", "sent ÷ state (formula)",
                  "rebuild of one node", "step overhead (this node)", "from the agent's CPU share",
                  "agent CPU per GB", "protected per snapshot", "steps at risk, max"], rows) + [
        "", f"{config.get('nodes', '?')} nodes' agents on this one machine, {num(config.get('state_bytes'), 'B')} per "
        f"node for encode and rebuild; a trainer of {num(config.get('params'))} parameters snapshots every step; "
        f"agents capped at {cap}, nice {config.get('nice', '?')}, {config.get('window_s', '?')} s of free running. "
        "Target: step overhead ≤ 2 %."]


def transport(d: dict[str, Any]) -> list[str]:
    """Protect pass and rebuild per scheme over each transport."""
    runs = d.get("runs") or []
    transports = list(dict.fromkeys(r["transport"] for r in runs))
    by = {(r["scheme"], r["transport"]): r for r in runs}
    rows = [[f"`{s}`", *(num(by.get((s, t), {}).get("protect_s"), "s") for t in transports),
             *(num(by.get((s, t), {}).get("rebuild_s"), "s") for t in transports)]
            for s in dict.fromkeys(r["scheme"] for r in runs)]
    config = d.get("config") or {}
    return table(["scheme", *(f"protect pass, {t.upper()}" for t in transports),
                  *(f"rebuild, {t.upper()}" for t in transports)], rows) + [
        "", f"{config.get('nodes', '?')} nodes × {config.get('ranks_per_node', '?')} ranks, "
        f"{num(config.get('state_bytes_per_node'), 'B')} per node, agents uncapped; "
        f"{_launches(config.get('repeats'))} each (the slowest agent's pass)."]


def _launches(n: int | None) -> str:
    return "one launch" if n == 1 else f"the median of {n if n else '?'} launches"


RECOVERY = (("rank_kill", "rank kill (relaunch in place)"), ("exception", "exception (in-process restart)"),
            ("node_crash", "node crash (spare takes the slot)"), ("batch_host", "batch host lost (requeue)"),
            ("baseline_relaunch", "without hpcft: torch.save, srun again, torch.load"),
            ("baseline_requeue", "without hpcft: torch.save, scontrol requeue, torch.load"))


def recovery_rows(d: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(key, label, phases) of every scenario the report holds, in RECOVERY's order."""
    phases = d.get("phases") or {}
    taken = (phases.get("batch_host") or {}).get("requeued") is False  # a janitor took over (older runs: requeue)
    return [(k, label.replace("(requeue)", "(taken over)") if k == "batch_host" and taken else label, phases[k])
            for k, label in RECOVERY if k in phases]


def restart_s(ph: dict[str, Any]) -> float | None:
    """The part between detection and restore: a relaunch, or an in-process restart's abort and new groups."""
    if "relaunch_s" in ph:
        return ph["relaunch_s"]
    parts = [ph.get("abort_barrier_s"), ph.get("new_groups_s")]
    return None if None in parts else sum(parts)


def recovery(d: dict[str, Any]) -> list[str]:
    """Fault → first step per scenario, cut into phases; the baselines against the rank kill; #14's targets."""
    kill = ((d.get("phases") or {}).get("rank_kill") or {}).get("total_s")
    rows = [[label, f"**{num(ph.get('total_s'), 's')}**", num(ph.get("detection_s"), "s"), num(restart_s(ph), "s"),
             num(ph.get("restore_s"), "s"), num(ph.get("first_step_s"), "s"),
             num(ph["total_s"] / kill if kill and ph.get("total_s") else None, "x")] for _, label, ph in
            recovery_rows(d)]
    targets, met = d.get("targets") or {}, d.get("met") or {}
    judged = [f"`{k}` {cell(d, k, '' if k == 'restore_share' else 's')} (≤ {v}: "
              f"{'met' if met.get(k) else '**missed**'})" for k, v in targets.items() if k in d]
    config = d.get("config") or {}
    return table(["scenario", "fault → first step", "detection", "relaunch / restart", "restore", "first step",
                  "÷ rank kill"], rows) + [
        "", f"Targets (#14): {'; '.join(judged) or MISSING}. Node crash from Slurm's mark: "
        f"{cell(d, 'node_crash_s', 's')}; batch host: Slurm's mark → a janitor acts "
        f"{cell(d, 'batch_host_s', 's')}. Every faulted run ended bit-identical to a fault-free one: "
        f"{num(d.get('identical'))}. Job: {config.get('ranks', '?')} ranks + {config.get('spares', '?')} spares, "
        f"{num(config.get('params'))} parameters, {config.get('steps', '?')} steps, fault after step "
        f"{config.get('fault_at', '?')}, node crash `{config.get('crash', '?')}`."]


SCALE = (("setup_s", "s", "mesh setup"), ("setup_cpu_ms", "ms", "its CPU per agent"),
         ("agree_ms", "ms", "agreement (slowest agent)"), ("agree_cpu_ms", "ms", "its CPU per agent"),
         ("agree_bytes_per_agent", "B", "its bytes per agent"), ("gather_cpu_ms", "ms", "all-gather CPU per agent"),
         ("sockets_per_agent", "", "sockets per agent"), ("connections_per_agent", "", "connections per agent"),
         ("beat_Bps_per_agent", "B/s", "heartbeat bytes per agent"))


def scale(d: dict[str, Any]) -> list[str]:
    """Per N the fabric's figures, their growth exponent and the fit's value at 9,408 nodes."""
    per_n = d.get("per_n") or {}
    ns = sorted(per_n, key=int)
    growth = d.get("growth") or {}
    rows = [[label, *(num(per_n[n].get(key), unit) for n in ns),
             num((growth.get(key) or {}).get("exponent")),
             num((growth.get(key) or {}).get("at_9408_by_log2n"), unit)] for key, unit, label in SCALE]
    f = d.get("frontier") or {}
    return table(["figure", *(f"N = {n}" for n in ns), "growth exponent", "fit at 9,408"], rows) + [
        "", f"Counted for {num(f.get('nodes'))} nodes, not measured: {f.get('agree_hops', '?')} hops per agreement, at "
        f"most {f.get('connections_per_agent_at_most', '?')} connections per agent (all-to-all: "
        f"{num(f.get('all_to_all_connections'))}). Wall times are this machine's (N agents share its cores); "
        "per-agent CPU, bytes and sockets are what each node pays."]


def reports(d: dict[str, Any]) -> list[str]:
    """Per N the supervisor's intake, CPU and bounded log."""
    results = sorted((v for k, v in d.items() if k.startswith("result_")), key=lambda r: r["nodes"])
    rows = [[num(r["nodes"]), num(r.get("sent_hz")), num(r.get("received_hz")), num(r.get("report_bytes"), "B"),
             num(r.get("supervisor_cpu")), f"{num(r.get('us_per_report'))} µs", num(r.get("log_bytes"), "B"),
             num(r.get("log_writes_hz"))] for r in results]
    return table(["nodes", "reports sent/s", "received/s", "bytes per report", "supervisor CPU (cores)",
                  "CPU per report", "bounded log", "log writes/s"], rows)


SECTIONS = (
    Section("snapshot", "Snapshot every step: `hpcft bench snapshot`",
            "What a training step pays to checkpoint every step: one trainer takes its steps with no checkpoint, an "
            "hpcft snapshot, torch.save and dcp.async_save in turn, interleaved in blocks, and each is reported as its "
            "overhead over the step without. hpcft's copy (with its checksums) is also timed against a memcpy of the "
            "same bytes, and a node agent's durable flush against a plain write.",
            "hpcft bench snapshot --json", snapshot),
    Section("restore", "Restore: `hpcft bench restore`",
            "How fast the state after one AdamW step comes back into a live model and optimizer: from hpcft's store "
            "(warm, and as a relaunched process does), by dcp.load and by torch.load from local disk, interleaved and "
            "checked bit for bit. Reported against a memcpy of the same bytes and as speedups over the baselines.",
            "hpcft bench restore --json", restore),
    Section("protect", "Protection across nodes: `hpcft bench protect`",
            "The cost of protecting snapshots across nodes per scheme (xor, partner copies, Reed–Solomon), with four "
            "real agents on four store roots of this machine: encode against memcpy, the bytes sent and stored "
            "against the formula, a rebuild of one node, and a trainer's step with protection running against "
            "stopped (node 0's share of the four agents' cost). The agents run capped as `hpcft run` caps them, so "
            "how far protection lags the snapshots (steps at risk) is measured too.",
            "hpcft bench protect --json", protect),
    Section("transport", "Agent transports: `hpcft bench transport`",
            "The agents' two transports side by side: TCP processes and MPI ranks under mpirun, four agents on this "
            "machine. Per scheme the slowest agent's protect pass and the rebuild of one lost node.",
            "hpcft bench transport --json", transport),
    Section("recovery", "Recovery time: `hpcft bench recovery`",
            "Time from a fault to the first training step completed after it, in the local Slurm sandbox, for one "
            "4-rank job under each kind of fault and under what a user does without hpcft (torch.save every step, "
            "then srun again or requeue, torch.load), cut into detection, relaunch, restore and first step; every "
            "faulted run must end bit-identical to a fault-free one.",
            "hpcft bench recovery --json", recovery),
    Section("scale", "The agents' fabric at scale: `hpcft bench scale`",
            "N real agent processes on loopback addresses of this machine, meshed as `hpcft run` meshes them: mesh "
            "setup, agreement latency and CPU, heartbeat bytes and sockets per agent. Each figure's growth with N is "
            "fitted, and the fit extrapolated to Frontier's 9,408 nodes (a model, labelled so).",
            "hpcft bench scale --json", scale),
    Section("reports", "The supervisor's report service: `hpcft bench reports`",
            "N nodes' steady reports (a status delta and 8 ranks' progress, once a second each) from one client "
            "process into the supervisor's real report service: the reports it received, its CPU per report, and "
            "the size and writes of its bounded log.",
            "hpcft bench reports --json", reports),
)
