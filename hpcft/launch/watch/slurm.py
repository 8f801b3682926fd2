"""The supervisor's looks at its nodes in Slurm while the trainers run, as policy/slurmlook.py says: the signs of
trouble gathered each poll (srun's lines, nodes whose reports went silent), then one `scontrol show node` of the slots
on the slow timer, or that and `scontrol show job` on suspicion. Events: node_closed, node_bad (NodeCheck)."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from hpcft.launch.fabric.liveview import LiveView
from hpcft.launch.policy.layout import Layout
from hpcft.launch.policy.slurmlook import SlurmLooks, srun_trouble
from hpcft.launch.node.nodecheck import NodeCheck

_log = logging.getLogger(__name__)


class SlurmWatch:
    """One launch's watch (`poll` once per supervisor poll): {node: why} of the slots' nodes Slurm says are lost."""

    def __init__(self, nodes: NodeCheck, view: LiveView, layout: Layout, period: float, launched: float,
                 said: Sequence[str], clock: Callable[[], float] = time.time):
        self.nodes, self.view, self.layout, self.said, self.clock = nodes, view, layout, said, clock
        self.launched = launched
        self.looks = SlurmLooks(period, last=clock())  # the launch asked Slurm already
        self.read = 0  # srun's lines looked at
        self.silent: set[int] = set()  # the slots silent at the last poll: a suspicion once per silence, not forever
        self.asked = 0  # looks taken (for tests and the bench)

    def signs(self, now: float) -> None:
        """The signs of trouble since the last poll: srun's new lines, slots whose node went silent."""
        lines = self.said[self.read:]
        self.read += len(lines)
        if (trouble := srun_trouble(lines)) is not None:
            self.looks.suspect(now, trouble)
        silent = set(self.view.silent(len(self.layout.slots), now, self.launched))
        if fresh := silent - self.silent:  # a node whose reporter cannot reach us is no reason to poll Slurm for good
            self.looks.suspect(now, "no report from " + ",".join(self.layout.slots[s] for s in sorted(fresh)))
        self.silent = silent

    def poll(self) -> dict[str, str]:
        """Ask Slurm if due, after this poll's signs: the slots' lost nodes (a drain alone stops nothing)."""
        now = self.clock()
        self.signs(now)
        why = self.looks.due(now)
        if why is None:
            return {}
        bad = self.nodes.bad(self.layout.slots, probe=False, closed=False, allocation=why != "timer")
        self.looks.looked(self.clock())
        self.asked += 1
        if why != "timer":
            _log.info("asked Slurm on %s: %s", why, bad or "no node lost")
        return bad
