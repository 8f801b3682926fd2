"""Which node is a straggler (docs/reference/supervisor.md, "Stragglers"), pure, time passed in: a rank is slow when
the median of its `ready_s` (its own share of a step) over the last `window` s is over `factor` × the other nodes'
ranks' median. The median keeps it persistent: one paused step inflates one sample, never most of the `min_samples` a
judgement needs."""
import statistics
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StragglerRules:
    """factor: how much slower than the peers' median counts (0: off); window: the seconds judged; min_samples: the
    fewest samples of a rank, spanning at least half the window, that a judgement of it needs; floor_s: a rank is
    never slow by less than this many seconds over its peers (a millisecond step's scheduling noise is no straggler)."""
    factor: float = 1.5
    window: float = 30.0
    min_samples: int = 3
    floor_s: float = 0.05

    @property
    def clear_factor(self) -> float:
        """A straggler is cleared below half-way between 1 and `factor` (no flapping at the threshold)."""
        return 1.0 + (self.factor - 1.0) / 2.0


@dataclass(frozen=True)
class Verdict:
    """One node's judgement: its slow ranks, the slowest one's windowed median and its peers' median."""
    node: str
    ranks: tuple[int, ...]
    ready_s: float
    peers_s: float

    @property
    def ratio(self) -> float:
        return self.ready_s / self.peers_s if self.peers_s > 0 else float("inf")


@dataclass
class Detector:
    """The samples seen (per rank: [(time, step, ready_s)]) and the nodes now named stragglers."""
    rules: StragglerRules
    samples: dict[int, list[tuple[float, int, float]]] = field(default_factory=dict)
    node_of: dict[int, str] = field(default_factory=dict)
    named: dict[str, Verdict] = field(default_factory=dict)

    def observe(self, rank: int, node: str, step: int, ready_s: float, now: float) -> None:
        """One rank's measure at one step (a step already seen for that rank is ignored)."""
        seen = self.samples.setdefault(rank, [])
        if seen and seen[-1][1] == step:
            return
        self.node_of[rank] = node
        seen.append((now, step, ready_s))
        del seen[:-256]  # bounded: far more than a window holds at a supervisor's poll rate

    def measure(self, rank: int, now: float) -> float | None:
        """The median of `rank`'s samples in the window, or None when too few (or too short a span) to judge."""
        recent = [s for s in self.samples.get(rank, []) if s[0] >= now - self.rules.window]
        if len(recent) < self.rules.min_samples or recent[-1][0] - recent[0][0] < self.rules.window / 2:
            return None
        return statistics.median(v for _, _, v in recent)

    def judge(self, now: float) -> tuple[list[Verdict], list[Verdict]]:
        """(nodes newly named stragglers, nodes cleared): each node at most once until its state changes."""
        if self.rules.factor <= 0:
            return [], []
        known = {r: m for r in self.samples if (m := self.measure(r, now)) is not None}
        judged: dict[str, list[tuple[float, int, float, float]]] = {}  # node: [(ratio, rank, value, peers' median)]
        for rank, value in known.items():
            node = self.node_of[rank]
            peers = [m for r, m in known.items() if self.node_of[r] != node]
            if peers:
                base = statistics.median(peers)
                judged.setdefault(node, []).append((value / base if base > 0 else float("inf"), rank, value, base))
        new, cleared = [], []
        for node, ranks in sorted(judged.items()):
            worst, _, value, base = max(ranks)
            slow = [rank for ratio, rank, v, b in ranks if ratio > self.rules.factor and v - b > self.rules.floor_s]
            verdict = Verdict(node, tuple(sorted(slow)), value, base)
            if slow and node not in self.named:
                self.named[node] = verdict
                new.append(verdict)
            elif node in self.named and (worst < self.rules.clear_factor or value - base <= self.rules.floor_s):
                del self.named[node]
                cleared.append(verdict)
        return new, cleared


def eviction_blocked(*, evict: bool, protected: bool, spares: int, restarts: int, max_restarts: int) -> str | None:
    """Why a straggler is only reported, not evicted, or None to evict it at the next protected step."""
    if not evict:
        return "--evict-stragglers is off"
    if not protected:
        return "nothing protects its snapshots across nodes (--protect none): a spare would start from step 0"
    if spares < 1:
        return "no spare left to take its slot"
    if restarts >= max_restarts:
        return f"the run has used its {max_restarts} relaunch(es) (--max-restarts)"
    return None
