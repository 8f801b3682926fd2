"""`hpcft status`: a read-only view of a job's in-memory checkpoints, for people: per node (slot) and rank the versions
held and how far each got (staged → protected → persisted), the agents' heartbeats, each protection set's health and
the stragglers named. Reads only the supervisor's bounded log `<job dir>/status.json` (what the agents reported, at
most once a second), or the status files of agents started by hand, and the job's events: it never waits on a node."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from hpcft import events
from hpcft.agent import status as agent_status
from hpcft.errors import ConfigError

if TYPE_CHECKING:
    from hpcft.agent.protection.placement import Placement

STAGED, PROTECTED, PERSISTED = "staged", "protected", "persisted"
HEALTHY, DEGRADED, AT_RISK, STOPPED = "healthy", "degraded", "at risk", "stopped"
BEHIND = "behind"  # every member fresh, but protection stopped keeping up with the trainers (a stall)
MIN_STALE_S = 30.0
MIN_STALL_S = 10.0  # protection not advanced for this long (or 5 rounds) while the trainers went on: a stall


@dataclass
class NodeView:
    """One slot as its agent last reported it; `fresh` is false when the agent is silent, failed or absent."""
    slot: int
    node: str | None
    phase: str
    heartbeat_age_s: float | None
    fresh: bool
    staged: int | None = None
    protected: int | None = None
    persisted: int | None = None  # the newest durable step on the shared file system
    local: int | None = None  # the newest step in this node's first level of the durable tier (node-local NVMe)
    lag_steps: int | None = None  # newest staged step − newest protected step
    lag_s: float | None = None  # seconds between those two snapshots
    cpu_cores: float | None = None  # the agent's CPU cap in force (raised by a lag bound, `--protect-lag`)
    cpu_budget: float | None = None  # its CPU budget in cores (`--agent-cores`), and the most a lag bound raises it to
    cpu_ceiling: float | None = None
    cpu_set: int | None = None  # the cores it may run on (its step's cpuset and affinity)
    autogroup_nice: int | None = None  # its session's priority against the trainers' (None: not its to change)
    ranks: dict[str, list[int]] = field(default_factory=dict)
    steps: dict[str, str] = field(default_factory=dict)  # step → staged / protected / persisted
    error: str | None = None


@dataclass
class SetView:
    """A protection set: its members, the newest step every member holds a record of, and its health."""
    index: int
    members: list[int]
    health: str
    missing: list[int]
    protected_step: int | None  # the newest step every member holds and has a record of
    detail: str


@dataclass
class StragglerView:
    """A node the supervisor named a straggler in this launch (`straggler` event), and whether it was evicted."""
    node: str
    ranks: str
    ready_s: float
    peers_s: float
    ratio: float
    since: float
    evicted: bool = False


@dataclass
class JobView:
    rendezvous: str
    tag: str | None
    scheme: dict[str, Any]
    stale_after_s: float
    nodes: list[NodeView]
    sets: list[SetView]
    stragglers: list[StragglerView] = field(default_factory=list)
    training: int | None = None  # the newest step the trainers completed (their progress, else the newest staged)
    steps_at_risk: int | None = None  # staged steps a node lost now would cost: newest staged − newest resumable
    warnings: list[str] = field(default_factory=list)
    supervisor: dict[str, Any] | None = None  # who supervises (node, generation, took over from) and how the run ended


def collect(rendezvous: str | Path, tag: str | None = None, stale_after: float | None = None,
            now: float | None = None) -> JobView:
    """Everything `hpcft status` shows, from the status files under `rendezvous` (launch `tag`, or the newest)."""
    from hpcft.agent.protection.placement import Scheme, plan  # here, so `hpcft --help` stays light

    where = Path(rendezvous)
    if not where.is_dir():
        raise ConfigError(f"{where} is not a directory; pass the job directory or its agents/ rendezvous directory")
    if not any(where.glob("agent-*.status")) and (where / "agents").is_dir():
        where = where / "agents"  # the job directory of `hpcft run` (its agents' rendezvous is <job dir>/agents)
    log = agent_status.read_log(where)
    reports = agent_status.read(where, tag)
    if tag is None:
        reports = _newest_launch(reports)
    if not reports:
        raise ConfigError(f"no agent reports in {where}: neither the supervisor's {agent_status.LOG} nor status files "
                          f"(agent-<tag>-<slot>.status)"
                          + (f" for launch {tag}" if tag is not None else "") + "; are the agents running there?")
    now = time.time() if now is None else now
    first = reports[min(reports)]
    scheme = Scheme(first.get("scheme", "none"), int(first.get("group", 4)), int(first.get("losses", 1)),
                    int(first.get("distance", 1)))
    slots = max([int(first.get("slots") or 0), max(reports) + 1])
    interval = max(float(v.get("interval") or 0) for v in reports.values())
    stale = stale_after if stale_after is not None else max(MIN_STALE_S, 5 * interval)
    nodes = [_node(s, reports.get(s), now, stale) for s in range(slots)]
    placement = plan(slots, scheme) if scheme.name != "none" else None
    _mark_steps(nodes, placement, reports)
    record = events.read(where.parent) if where.parent.is_dir() else []
    cleaned = _cleaned(record)
    sets = [_set_view(placement, pset.index, list(pset.members), nodes, reports, cleaned) for pset in placement.sets] \
        if placement else []
    view = JobView(str(where), tag, asdict(scheme), stale, nodes, sets, stragglers(record),
                   supervisor=supervision(where.parent, record))
    _judge_lag(view, reports, log, now, max(MIN_STALL_S, 5 * interval))
    return view


def supervision(job_dir: Path, record: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Who supervises the job (the batch script's hpcft run, or a janitor that took over: launch/node/succession.py),
    from whom it took over, and how the run ended (its summary), if it has."""
    from hpcft.launch.node import succession

    found = succession.read(job_dir)
    if found is None:
        return None
    took = [e for e in record if e.get("event") == "takeover"]
    ended = [e for e in record if e.get("event") == "summary"]
    return {"node": found.host, "generation": found.generation,
            "took_over_from": took[-1].get("lost") if took and found.generation else None,
            "ended": ({"action": ended[-1].get("action"), "exit_code": ended[-1].get("exit_code")}
                      if ended and ended[-1]["time"] >= found.started else None)}


def _newest_launch(reports: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The reports of the launch that reported last: an older launch's slot (before an elastic shrink, or a relaunch
    whose agents have not reported yet) is not a node of this one."""
    if not reports:
        return reports
    tag = max(reports.values(), key=lambda r: r.get("time", 0)).get("tag")
    return {s: r for s, r in reports.items() if r.get("tag") == tag}


def _cleaned(record: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The supervisor's `cleaned` event, when the job's stores left the nodes' memory after its newest launch."""
    found = None
    for e in record:
        if e.get("event") in ("launch", "agents_launch"):
            found = None
        elif e.get("event") == "cleaned" and e.get("exit_code") == 0:
            found = e
    return found


def _judge_lag(view: JobView, reports: dict[int, dict[str, Any]], log: dict[str, Any], now: float,
               stall_s: float) -> None:
    """The steps a node lost now would cost (`steps_at_risk`), and a warning, and sets marked `behind`, when
    protection trails the trainers past the agents' lag bound or has not advanced for `stall_s` while they went on."""
    live = [n for n in view.nodes if n.fresh]
    progress = [int(v[0]) for v in (log.get("progress") or {}).values() if v]
    staged = [n.staged for n in live if n.staged is not None]
    view.training = max(progress or staged) if progress or staged else None
    if view.training is None or not view.sets:
        return
    guarded = [s.protected_step for s in view.sets]
    durable = max((n.persisted for n in view.nodes if n.persisted is not None), default=None)
    floors = [f for f in (None if None in guarded else min(guarded), durable) if f is not None]
    newest = max(staged, default=view.training)  # the trainers' step in flight is lost whatever protection does
    view.steps_at_risk = max(0, newest - max(floors)) if floors else newest
    bound = max((int(r["lag_bound"]) for r in reports.values() if r.get("lag_bound")), default=None)
    since = max((float(r["behind_since"]) for r in reports.values() if r.get("behind_since")), default=None)
    still = None if since is None else now - since
    behind = view.training - max(floors) if floors else view.training
    if bound is not None and view.steps_at_risk > bound:
        why = f"over the agents' lag bound of {bound} (--protect-lag)"
    elif behind >= 2 and still is not None and still > stall_s:
        why = f"protection has not advanced for {still:.0f} s while the trainers went on"
    else:
        return
    view.warnings.append(f"protection trails the trainers by {behind} steps ({why}): a node lost now loses them; "
                         f"see the agents' events (protect_*, flush_*) in the job's events.jsonl")
    for s in view.sets:
        if s.health == HEALTHY and (s.protected_step is None or s.protected_step < view.training - 1):
            s.health, s.detail = BEHIND, f"every member fresh, but protection trails the trainers at {view.training}"


def stragglers(record: list[dict[str, Any]]) -> list[StragglerView]:
    """The stragglers named in the job's events and not cleared since (a new launch judges afresh; evicted stay)."""
    named: dict[str, StragglerView] = {}
    for e in record:
        kind = e.get("event")
        if kind == "straggler":
            named[e["node"]] = StragglerView(e["node"], str(e.get("ranks", "")), e.get("ready_s", 0.0),
                                             e.get("peers_s", 0.0), e.get("ratio", 0.0), e.get("time", 0.0))
        elif kind == "straggler_cleared":
            named.pop(e.get("node"), None)
        elif kind == "launch":
            named = {n: v for n, v in named.items() if v.evicted}
        elif kind == "decision" and e.get("action") == "evict":
            for node in str(e.get("bad_nodes", "")).split(","):
                if node in named:
                    named[node].evicted = True
    return list(named.values())


def _node(slot: int, rep: dict[str, Any] | None, now: float, stale: float) -> NodeView:
    if rep is None:
        return NodeView(slot, None, "absent", None, False, error="no status file")
    age = max(0.0, now - float(rep.get("time", 0)))
    phase = rep.get("phase", "?")
    said = {k: rep.get(k) for k in ("staged", "protected", "persisted", "local", "lag_steps", "lag_s", "cpu_cores",
                                    "cpu_budget", "cpu_ceiling", "cpu_set", "autogroup_nice", "error")}
    return NodeView(slot, rep.get("node"), phase, round(age, 3), phase not in agent_status.TERMINAL and age <= stale,
                    ranks={str(r): list(v) for r, v in (rep.get("versions") or {}).items()}, **said)


def _records(reports: dict[int, dict[str, Any]], slot: int) -> set[int]:
    """The steps `slot` holds a protection record of and still holds the snapshot of (a record of a step its ranks no
    longer hold, left by a run that restarted from further back, protects nothing)."""
    rep = reports.get(slot) or {}
    held = {int(s) for steps in (rep.get("versions") or {}).values() for s in steps}
    return set(rep.get("protected_steps") or []) & held


def _guards(placement: Placement, slot: int) -> list[int]:
    """The slots whose records make `slot`'s snapshot recoverable: its set (xor/rs) or its partner."""
    if placement.scheme.name == "partner":
        return [placement.partner_of(slot)]
    return list(placement.set_of(slot).members)


def _mark_steps(nodes: list[NodeView], placement: Placement | None, reports: dict[int, dict[str, Any]]) -> None:
    """Each held step's state: persisted (≤ the persisted step), protected (every guard holds its record), staged."""
    for n in nodes:
        held = sorted({s for v in n.ranks.values() for s in v})
        for step in held:
            if n.persisted is not None and step <= n.persisted:
                state = PERSISTED
            elif placement and all(step in _records(reports, g) for g in _guards(placement, n.slot)):
                state = PROTECTED
            else:
                state = STAGED
            n.steps[str(step)] = state


def _set_view(placement: Placement, index: int, members: list[int], nodes: list[NodeView],
              reports: dict[int, dict[str, Any]], cleaned: dict[str, Any] | None) -> SetView:
    common = set.intersection(*(_records(reports, m) for m in members))
    step = max(common) if common else None
    stopped = [m for m in members if nodes[m].phase == agent_status.STOPPED]
    missing = [m for m in members if not nodes[m].fresh and m not in stopped]
    if not missing:
        if stopped and cleaned is not None:
            return SetView(index, members, STOPPED, [], step, "the job ended and its snapshots were removed from the "
                           "nodes' memory (event cleaned); what is left is the durable tier's (persisted)")
        if stopped:
            return SetView(index, members, STOPPED, [], step, "the agents were asked to stop (the job ended or is "
                           "between launches); the data they reported is in their nodes' memory unless a node was "
                           "lost since")
        return SetView(index, members, HEALTHY, [], step, "every member fresh")
    from hpcft.agent.protection.codec import Unrecoverable
    from hpcft.agent.protection.rebuild import lost_slots

    alive = [s not in missing for s in range(placement.slots)]  # judge this set's losses alone
    why = ", ".join(f"slot {m} {_why(nodes[m])}" for m in missing)
    try:
        lost_slots(placement, alive, alive)
    except Unrecoverable as exc:  # status files cannot tell a lost node from a dead agent on a live one
        return SetView(index, members, AT_RISK, missing, step, f"{why}; {exc}: were those nodes lost, the set "
                       "could not be rebuilt; if only their agents died, their data is still in memory")
    return SetView(index, members, DEGRADED, missing, step, f"{why}; still rebuildable from the others")


def _why(n: NodeView) -> str:
    if n.phase == "absent":
        return "has no agent status"
    if n.phase == agent_status.FAILED:
        return f"agent failed ({n.error})"
    return f"silent for {n.heartbeat_age_s:.0f} s"


def render(view: JobView) -> str:
    """The human table."""
    sc = view.scheme
    lines = [f"WARNING: {w}" for w in view.warnings]
    if view.supervisor:
        sup = view.supervisor
        lines.append(f"supervisor on {sup['node']}"
                     + (f" (generation {sup['generation']}: took over from {sup['took_over_from']})"
                        if sup["generation"] else "")
                     + (f"; the run ended: {sup['ended']['action']}, exit status {sup['ended']['exit_code']}"
                        if sup["ended"] else ""))
    lines += [f"rendezvous {view.rendezvous}  launch {view.tag or 'newest'}  scheme {sc['name']}"
             + (f" (group {sc['group']}, losses {sc['losses']})" if sc["name"] in ("xor", "rs") else "")
             + (f" (distance {sc['distance']})" if sc["name"] == "partner" else ""),
             f"{'slot':>4}  {'node':<14} {'phase':<11} {'heartbeat':>9}  {'staged':>6} {'protected':>9} "
             f"{'persisted':>9} {'nvme':>5} {'lag':>12}  versions (rank: steps)"]
    for n in view.nodes:
        old = n.heartbeat_age_s is not None and n.heartbeat_age_s > view.stale_after_s
        age = "-" if n.heartbeat_age_s is None else f"{n.heartbeat_age_s:.1f} s" + ("!" if old else "")
        versions = "; ".join(f"{r}: " + ",".join(f"{s}{_mark(n.steps.get(str(s)))}" for s in steps)
                             for r, steps in sorted(n.ranks.items(), key=lambda kv: int(kv[0])))
        lag = "-" if n.lag_steps is None else f"{n.lag_steps}" + ("" if n.lag_s is None else f" ({n.lag_s:.1f} s)")
        lines.append(f"{n.slot:>4}  {(n.node or '-'):<14} {n.phase:<11} {age:>9}  {_opt(n.staged):>6} "
                     f"{_opt(n.protected):>9} {_opt(n.persisted):>9} {_opt(n.local):>5} {lag:>12}  {versions or '-'}")
    lines += _cpu_lines(view.nodes)
    for s in view.sets:
        lines.append(f"set {s.index} slots {','.join(map(str, s.members))}: {s.health}"
                     f" (newest step protected on all: {_opt(s.protected_step)}; {s.detail})")
    if view.training is not None:
        lines.append(f"trainers at step {view.training}; steps at risk (lost if a node were lost now): "
                     f"{_opt(view.steps_at_risk)}")
    for v in view.stragglers:
        lines.append(f"straggler {v.node} ranks {v.ranks}: ready {v.ready_s:.3f} s vs the peers' {v.peers_s:.3f} s "
                     f"({v.ratio:.2f}x)" + (", evicted onto a spare" if v.evicted else ""))
    lines.append("persisted: newest durable step on the shared file system; nvme: newest in the node's first level "
                 "(drained to it); lag: steps (and seconds) the newest protected snapshot trails the newest staged "
                 "one; versions: * protected, ** persisted, plain staged; ! heartbeat older than "
                 f"{view.stale_after_s:g} s")
    return "\n".join(lines)


def _cpu_lines(nodes: list[NodeView]) -> list[str]:
    """The agents' CPU budget, once for all when they agree (they are told the same), with the cap in force."""
    said = {(n.cpu_budget, n.cpu_ceiling, n.cpu_set, n.autogroup_nice) for n in nodes if n.cpu_budget is not None}
    if not said:
        return []
    caps = sorted({n.cpu_cores for n in nodes if n.cpu_cores is not None})
    out = []
    for budget, ceiling, cpus, nice in sorted(said, key=str):
        below = (f"below the trainers (autogroup nice {nice})" if nice else "at the trainers' priority now (a "
                 "persist, or over the lag bound)" if nice == 0 else "below the trainers by a plain nice only")
        out.append(f"agents' CPU: budget {budget:g} cores each" + (f", up to {ceiling:g} over the lag bound"
                                                                   if ceiling and ceiling > budget else "")
                   + f", over the {cpus} cores they may run on, {below}")
    if caps:
        out.append("agents' CPU cap in force: " + ", ".join(f"{c:g}" for c in caps) + " cores")
    return out


def _opt(x: Any) -> str:
    return "-" if x is None else str(x)


def _mark(state: str | None) -> str:
    return {PROTECTED: "*", PERSISTED: "**"}.get(state or "", "")


@click.command("status")
@click.argument("rendezvous", metavar="JOB_DIR|RENDEZVOUS", type=click.Path(file_okay=False))
@click.option("--tag", default=None, help="Launch tag (restart count) to show [default: the newest per slot].")
@click.option("--stale", type=float, default=None,
              help=f"Seconds without a heartbeat before an agent counts as missing [default: max({MIN_STALE_S:g}, "
                   "5 × the protect interval)].")
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of the table.")
def status(rendezvous: str, tag: str | None, stale: float | None, as_json: bool) -> None:
    """Versions held per node and rank, their protection state, agent heartbeats and each protection set's health."""
    import json

    view = collect(rendezvous, tag, stale)
    click.echo(json.dumps(asdict(view), sort_keys=False) if as_json else render(view))
