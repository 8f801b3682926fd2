"""The supervisor's straggler watch (docs/reference/supervisor.md, "Stragglers"): it feeds the live view's samples to
the pure detector, says `straggler` / `straggler_cleared`, and with --evict-stragglers hands the supervisor an eviction
once the agents protected a step at or after the detection, so that the spare resumes from memory with nothing lost."""
import logging
import time
from collections.abc import Callable

from hpcft.launch.config.model import RunConfig
from hpcft.launch.policy.layout import Layout
from hpcft.launch.policy.failures import Action, Decision, Event, Kind
from hpcft.launch.policy.stragglers import Detector, StragglerRules, Verdict, eviction_blocked


class StragglerWatch:
    """One per run; `launched` starts each launch's judgement afresh (ranks may have moved), `poll` watches."""

    def __init__(self, cfg: RunConfig, samples: Callable[[], dict[int, tuple[int, float | None, float]]],
                 emit: Callable[..., None]):
        self.cfg, self.samples, self.emit = cfg, samples, emit  # samples(): {rank: (step, ready_s, changed at)}
        self.detector = Detector(self.rules)
        self.since = 0.0
        self.restarts = 0  # the run's relaunches so far: an eviction is not made past --max-restarts
        self._next_read = 0.0  # the samples are judged every tenth of the window, not every poll
        self.pending: dict[str, tuple[Verdict, int]] = {}  # node: (verdict, the step to protect before its eviction)
        self.evicted: list[str] = []  # nodes retired from the slots (their stores are cleaned at the run's end)
        self._said: list[str] = []  # each eviction, for the run's summary

    @property
    def rules(self) -> StragglerRules:
        return StragglerRules(self.cfg.stragglers.straggler_factor, self.cfg.stragglers.straggler_window)

    def launched(self, cfg: RunConfig, restarts: int, now: float | None = None) -> None:
        """A new launch on `cfg` (a shrunk job's protection differs): judged afresh, its ranks may have moved."""
        self.cfg, self.restarts = cfg, restarts
        self.detector = Detector(self.rules)
        self._next_read = 0.0
        self.pending.clear()
        self.since = time.time() if now is None else now

    def poll(self, layout: Layout, protected: Callable[[], int | None],
             now: float | None = None) -> Event | None:
        """Feed the newest samples to the detector and say what it found; an eviction event when one is due."""
        now = time.time() if now is None else now
        if self.cfg.stragglers.straggler_factor <= 0 or now < self._next_read:
            return self._due(protected)
        self._next_read = now + self.cfg.stragglers.straggler_window / 10
        seen = self.samples()
        for rank, (step, ready, mtime) in seen.items():
            if ready is not None and mtime >= self.since and rank < layout.world_size:
                self.detector.observe(rank, layout.slots[rank // layout.tasks_per_node], step, ready, now)
        new, cleared = self.detector.judge(now)
        reached = min((s for r, (s, _, m) in seen.items() if m >= self.since and r < layout.world_size), default=0)
        for v in new:
            blocked = eviction_blocked(evict=self.cfg.stragglers.evict_stragglers,
                                       protected=self.cfg.protection.protected, spares=len(layout.spares),
                                       restarts=self.restarts, max_restarts=self.cfg.recovery.max_restarts)
            if blocked is None:
                self.pending[v.node] = (v, reached)
            self.emit("straggler", level=logging.WARNING, node=v.node, ranks=",".join(map(str, v.ranks)),
                      ready_s=round(v.ready_s, 4), peers_s=round(v.peers_s, 4), ratio=round(v.ratio, 2),
                      factor=self.cfg.stragglers.straggler_factor, window_s=self.cfg.stragglers.straggler_window,
                      step=reached,
                      action="evict at the next protected step" if blocked is None else "reported only",
                      **({"reason": blocked} if blocked else {"protect_to": reached}))
        for v in cleared:
            self.pending.pop(v.node, None)
            self.emit("straggler_cleared", node=v.node, ready_s=round(v.ready_s, 4), peers_s=round(v.peers_s, 4),
                      ratio=round(v.ratio, 2))
        return self._due(protected)

    def _due(self, protected: Callable[[], int | None]) -> Event | None:
        """The eviction of the first pending straggler whose step the agents have protected, if any."""
        if not self.pending:
            return None
        safe = protected()
        for node, (v, step) in self.pending.items():
            if safe is not None and safe >= step:
                return Event(Kind.STRAGGLER, bad_nodes=(node,),
                             detail=f"{node}: ready_s {v.ready_s:.3f} s = {v.ratio:.2f}x the peers' median "
                                    f"{v.peers_s:.3f} s (--straggler-factor "
                                    f"{self.cfg.stragglers.straggler_factor:g}); step {safe} protected (detected at "
                                    f"step {step})")
        return None

    def carried_out(self, decision: Decision, event: Event) -> None:
        """Remember an eviction the supervisor carried out, for the clean-up and the summary."""
        if decision.action is Action.EVICT:
            self.evicted += list(decision.replaced)
            self._said += [f"{a} -> {b} ({event.detail})" for a, b in decision.replaced.items()]

    def summary(self) -> dict[str, str]:
        """The summary's `evicted=` field, when the run evicted a straggler."""
        return {"evicted": "; ".join(self._said)} if self._said else {}
