"""When a shrunk elastic job grows back (`--elastic-grow`), pure, clock passed in. Against thrashing: a returned node
must stay healthy `settle` s, doubled per earlier loss (a failed probe only restarts it: Slurm sees a dead node late, up
to its SlurmdTimeout); past `max_losses` losses never; one change of shape per `every` s; no grow with under `margin` s
of walltime left (a grow costs a relaunch). It takes settled nodes in allocation order up to the start's."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class GrowRules:
    """The bounds of growing back (from --grow-settle, --grow-every, --grow-max-losses, --requeue-margin)."""
    target: int              # active nodes the run started with: it grows no further
    settle: float = 60.0     # seconds a returned node must stay healthy (first return)
    every: float = 300.0     # seconds between two changes of shape
    max_losses: int = 2      # a node lost more often than this is not taken back
    margin: float = 300.0    # no grow with less walltime left than this


@dataclass(frozen=True)
class Seen:
    """A node out of the slots: healthy since when (None: not at the last look), and how often the run lost it."""
    healthy_since: float | None = None
    losses: int = 0


@dataclass(frozen=True)
class GrowChoice:
    """The nodes to take back now (empty: none now), and why, or why not; `blocked`: what holds settled nodes back
    (--grow-every, the walltime), empty when none are settled or they are taken."""
    nodes: tuple[str, ...]
    why: str
    blocked: str = ""


def settle_for(rules: GrowRules, losses: int) -> float:
    """How long a node lost `losses` times must stay healthy before it is taken back: doubled per earlier loss."""
    return rules.settle * 2 ** max(0, losses - 1)


def lost(seen: Mapping[str, Seen], nodes: Iterable[str]) -> dict[str, Seen]:
    """`seen` after the run lost `nodes` (a crash, a relapse): unhealthy, one loss more each."""
    out = dict(seen)
    for node in nodes:
        out[node] = Seen(None, out.get(node, Seen()).losses + 1)
    return out


def unsettled(seen: Mapping[str, Seen], nodes: Iterable[str]) -> dict[str, Seen]:
    """`seen` after `nodes` failed a probe: their settle time starts again at their next healthy look, no loss."""
    out = dict(seen)
    for node in nodes:
        out[node] = Seen(None, out.get(node, Seen()).losses)
    return out


def observe(seen: Mapping[str, Seen], healthy: Mapping[str, bool], now: float) -> tuple[dict[str, Seen], list[str]]:
    """`seen` after one look at the nodes out of the slots ({node: healthy now}), and the nodes that relapsed (healthy
    at the last look, not now: counted as a loss). A node first seen healthy is healthy from `now`."""
    out, relapsed = dict(seen), []
    for node, ok in healthy.items():
        before = out.get(node, Seen())
        if ok and before.healthy_since is None:
            out[node] = replace(before, healthy_since=now)
        elif not ok and before.healthy_since is not None:
            relapsed.append(node)
    return lost(out, relapsed), relapsed


def choose(active: int, seen: Mapping[str, Seen], rules: GrowRules, now: float, last_change: float,
           time_left: float | None) -> GrowChoice:
    """The settled nodes to take back now (`seen` in allocation order; `time_left`: None if unlimited)."""
    want = rules.target - active
    if want <= 0:
        return GrowChoice((), f"the job runs on {active} of its {rules.target} node(s)")
    settled = [n for n, s in seen.items() if s.healthy_since is not None and s.losses <= rules.max_losses
               and now - s.healthy_since >= settle_for(rules, s.losses)]
    if not settled:
        return GrowChoice((), "no returned node has stayed healthy for its settle time")
    if now - last_change < rules.every:
        return GrowChoice((), f"{','.join(settled)} settled, but the job changed shape {now - last_change:.0f} s ago "
                              f"(--grow-every {rules.every:g} s)", "grow_every")
    if time_left is not None and time_left < rules.margin:
        return GrowChoice((), f"{','.join(settled)} settled, but only {max(0.0, time_left):.0f} s of walltime are "
                              f"left (--requeue-margin {rules.margin:g} s)", "walltime")
    take = tuple(settled[:want])
    healthy = ", ".join(f"{n} for {now - seen[n].healthy_since:.0f} s" for n in take)  # type: ignore[operator]
    return GrowChoice(take, f"healthy {healthy}; {active + len(take)} of {rules.target} node(s)")


def next_look(seen: Mapping[str, Seen], rules: GrowRules, now: float, period: float, last_change: float) -> float:
    """When to ask Slurm about the returned nodes again: after `period` (--slurm-check-every), or sooner when a node
    seen healthy completes its settle time or a settled one its --grow-every wait (a decision is due then)."""
    due = [now + period]
    for s in seen.values():
        if s.healthy_since is not None and s.losses <= rules.max_losses:
            settled = s.healthy_since + settle_for(rules, s.losses)
            due.append(max(settled, last_change + rules.every))
    return min(t for t in due if t > now) if any(t > now for t in due) else now + period
