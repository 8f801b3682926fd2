"""The chaos run's faults: which kinds exist, the mix that weights them, and a seeded Poisson schedule (pure, so a
run is repeated exactly from its seed and printed before it starts)."""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass

from hpcft.errors import ConfigError

# kind → what it does to the run; the order is the default mix's and the report's
KINDS = {
    "rank_kill": "SIGKILL one rank",
    "node_crash": "one node (not the batch host) frozen, then powered off once the supervisor decided; back after "
                  "--repair-s",
    "exception": "an exception raised in one rank's training loop",
    "hang": "one rank stopped (SIGSTOP): no progress until the hang timeout",
    "straggler": "one node's ranks slowed to half speed for a while",
    "agent_kill": "SIGKILL one node agent while the trainers train",
    "kill_in_snapshot": "SIGKILL one rank right after its step, while its snapshot is copied",
    "kill_in_protect": "SIGKILL one node agent in the middle of a protection round",
    "kill_in_flush": "SIGKILL one node agent while it flushes to the durable tier",
    "two_nodes": "two nodes of one protection set crashed at once (beyond parity: the durable tier serves)",
    "corrupt_chunk": "bytes of the newest snapshot flipped in one node's store, then one of its ranks killed",
    "batch_host": "the node running hpcft run (it trains too) frozen, then powered off: a janitor takes over",
    "enospc": "one node's /dev/shm full for 8 s: its snapshots are skipped, training goes on",
    "walltime": "Slurm's walltime warning (USR1 to the batch script): protect, flush, requeue, resume",
}


# Named mixes. field: the 419 unexpected interruptions of Llama 3's 54-day run on 16k GPUs (Dubey et al. 2024, table
# 5) put on these kinds: GPU, host, NIC and other hardware faults (67.7 %) take the node out; software bugs (12.9 %)
# raise; network and NCCL watchdog faults (10.1 %) hang a rank; silent data corruption (1.4 %) is a corrupt chunk;
# dependencies (0.3 %) kill a rank
PRESETS = {"field": "node_crash=67.7,exception=12.9,hang=10.1,corrupt_chunk=1.4,rank_kill=0.3"}


@dataclass(frozen=True)
class Fault:
    """One planned fault: `at` seconds after the run's first step, its kind, and `pick` in [0, 1) that chooses the
    target among those present then (the slots change as spares take over)."""
    at: float
    kind: str
    pick: float

    def as_dict(self) -> dict:
        return asdict(self)


def parse_mix(text: str) -> dict[str, float]:
    """`kind=weight,…` (a bare kind weighs 1; `all`: every kind at 1; a PRESETS name) → {kind: weight}; ConfigError
    naming the bad part otherwise."""
    text = PRESETS.get(text.strip(), text)
    mix: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, weight = part.partition("=")
        names = list(KINDS) if name == "all" else [name]
        if name != "all" and name not in KINDS:
            raise ConfigError(f"--mix: unknown fault kind {name!r}; the kinds are {', '.join(KINDS)} (or all, "
                              f"or a preset: {', '.join(PRESETS)})")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            raise ConfigError(f"--mix: {part!r} has a weight that is not a number (write kind=2.5)") from None
        if w < 0:
            raise ConfigError(f"--mix: {part!r} has a negative weight")
        mix.update(dict.fromkeys(names, w))
    if not any(mix.values()):
        raise ConfigError(f"--mix {text!r} weighs no kind above 0: name at least one of {', '.join(KINDS)}")
    return {k: w for k, w in mix.items() if w > 0}


def draw(seed: int, mtbf: float, count: int, mix: dict[str, float]) -> list[Fault]:
    """`count` faults whose gaps are exponential with mean `mtbf` seconds (a Poisson process), each kind drawn by its
    weight in `mix`; the same arguments give the same schedule."""
    if mtbf <= 0 or count < 0:
        raise ConfigError(f"--mtbf must be > 0 and --faults >= 0 (got {mtbf}, {count})")
    rng = random.Random(seed)
    kinds, weights = list(mix), list(mix.values())
    at, out = 0.0, []
    for _ in range(count):
        at += rng.expovariate(1.0 / mtbf)
        out.append(Fault(round(at, 3), rng.choices(kinds, weights)[0], rng.random()))
    return out


def arrivals(seed: int, mtbf: float, until: float) -> list[float]:
    """The same process's arrival times up to `until` (the baseline's replay may outlast the schedule's count)."""
    rng = random.Random(seed)
    at, out = 0.0, []
    while True:
        at += rng.expovariate(1.0 / mtbf)
        if at > until:
            return out
        out.append(at)
        rng.choices([0], [1])  # the kind's draw and the pick's, so the times match draw()'s
        rng.random()
