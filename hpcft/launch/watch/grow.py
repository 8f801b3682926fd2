"""The watch of `--elastic-grow`: while a shrunk job trains, Slurm is asked about its allocation's nodes out of its
slots every --slurm-check-every, and when a node seen healthy completes its settle time (one `scontrol show node`; the
allocation is read once per shape); policy/grow.py decides when to take which back, each probed once before the
supervisor is told. Events:
node_back, node_relapse, node_unsettled, node_retired, grow_deferred."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from hpcft.errors import SlurmError
from hpcft.launch.policy import grow as policy_grow
from hpcft.launch.config.model import RunConfig
from hpcft.launch.policy.layout import Layout
from hpcft.launch.node.nodecheck import NodeCheck
from hpcft.launch.policy.failures import Event, Kind
from hpcft.slurm import state as slurmstate
from hpcft.slurm.runner import Runner

_log = logging.getLogger(__name__)


class GrowWatch:
    """`poll(layout)` while the trainers run: a NODES_RETURNED event when the policy takes nodes back, else None.
    `lost(nodes)` counts a loss of each node (a failure decision); `reshaped()` a shrink or grow (--grow-every)."""

    def __init__(self, cfg: RunConfig, runner: Runner, job_id: str, nodes: NodeCheck, emit: Callable[..., None],
                 clock: Callable[[], float] = time.time):
        self.cfg, self.runner, self.job_id, self.nodes, self.emit, self.clock = cfg, runner, job_id, nodes, emit, clock
        self.target = 0  # the active nodes the run started with (set by the supervisor)
        self.seen: dict[str, policy_grow.Seen] = {}
        self.last_change = clock()
        self._next_look = 0.0
        self._said: dict[str, str] = {}  # the last deferral / retirement said, so each is said once
        self._info: slurmstate.JobInfo | None = None  # the allocation, read once per shape (its nodes never return)

    @property
    def rules(self) -> policy_grow.GrowRules:
        cfg = self.cfg
        return policy_grow.GrowRules(self.target, cfg.elastic.grow_settle, cfg.elastic.grow_every,
                                     cfg.elastic.grow_max_losses, cfg.recovery.requeue_margin)

    def lost(self, nodes: Sequence[str]) -> None:
        """The run lost `nodes` (each one loss more, and unhealthy until seen healthy again)."""
        self.seen = policy_grow.lost(self.seen, nodes)

    def reshaped(self) -> None:
        """The job changed shape now (shrank or grew, or tried to)."""
        self.last_change = self.clock()
        self._said.pop("deferred", None)
        self._info = None  # the allocation and its end time read again: one `scontrol show job` per shape

    def poll(self, layout: Layout) -> Event | None:
        """Look (throttled) at the allocation's nodes out of `layout`'s slots; an event when the policy takes some."""
        now = self.clock()
        if not self.cfg.elastic.elastic_grow or len(layout.slots) >= self.target or now < self._next_look:
            return None
        self._next_look = now + self.cfg.recovery.slurm_check_every  # if Slurm does not answer
        cached = self._info is not None
        try:
            info = self._info = self._info or slurmstate.job_info(self.runner, self.job_id)
            out = [n for n in info.nodes if n not in layout.slots]
            states = slurmstate.node_states(self.runner, out)
        except SlurmError as exc:
            _log.warning("cannot look at the returned nodes: %s", exc)
            return None
        self._observe({n: not slurmstate.is_bad(states.get(n, "UNKNOWN")) for n in out}, states, now)
        self._next_look = max(now + self.cfg.launch.poll_interval, policy_grow.next_look(
            {n: self.seen[n] for n in out if n in self.seen}, self.rules, now, self.cfg.recovery.slurm_check_every,
            self.last_change))
        left = None if info.end_time is None else info.end_time - now
        choice = policy_grow.choose(len(layout.slots), {n: self.seen[n] for n in out if n in self.seen}, self.rules,
                                    now, self.last_change, left)
        if not choice.nodes:
            if choice.blocked and self._said.get("deferred") != choice.blocked:
                self._said["deferred"] = choice.blocked
                self.emit("grow_deferred", blocked=choice.blocked, reason=choice.why)
            return None
        taken = self._still_allocated(choice.nodes) if cached else choice.nodes
        if not taken:
            return None
        failed = self.nodes.probe(taken)
        if failed:  # Slurm's view lags behind a dead node (healthy until its SlurmdTimeout): settle again, no loss
            self.seen = policy_grow.unsettled(self.seen, failed)
            for node, why in failed.items():
                self.emit("node_unsettled", level=logging.WARNING, node=node, reason=why,
                          action="not taken back: its settle time starts again")
            return None
        return Event(Kind.NODES_RETURNED, returned=taken, detail=choice.why)

    def _still_allocated(self, nodes: tuple[str, ...]) -> tuple[str, ...]:
        """Those of `nodes` the allocation still holds, read fresh at the decision (Slurm excises a node it marked
        DOWN from a --no-kill job); () when Slurm does not answer."""
        try:
            self._info = slurmstate.job_info(self.runner, self.job_id)
        except SlurmError as exc:
            _log.warning("cannot read the allocation: %s", exc)
            return ()
        return tuple(n for n in nodes if n in self._info.nodes)

    def _observe(self, healthy: dict[str, bool], states: dict[str, str], now: float) -> None:
        before = self.seen
        self.seen, relapsed = policy_grow.observe(before, healthy, now)
        for node in relapsed:
            self._relapse(node, f"Slurm says {states.get(node, 'UNKNOWN')}")
        for node, s in self.seen.items():
            if s.healthy_since == now and (node not in before or before[node].healthy_since is None):
                if s.losses > self.rules.max_losses:
                    if self._said.get(node) != "retired":
                        self._said[node] = "retired"
                        self.emit("node_retired", level=logging.WARNING, node=node, losses=s.losses,
                                  reason=f"lost {s.losses} times (> --grow-max-losses {self.rules.max_losses}): "
                                         "not taken back")
                    continue
                self.emit("node_back", node=node, state=states.get(node, "UNKNOWN"), losses=s.losses,
                          settle=policy_grow.settle_for(self.rules, s.losses),
                          reason="in the allocation and healthy again: taken back once it stays healthy for `settle` s")

    def _relapse(self, node: str, why: str) -> None:
        s = self.seen[node]
        self.emit("node_relapse", level=logging.WARNING, node=node, losses=s.losses, reason=why,
                  settle=policy_grow.settle_for(self.rules, s.losses))
