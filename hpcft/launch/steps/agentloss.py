"""What the supervisor makes of failed node agents, the job's own failure detector: the nodes they name are probed at
once beside healthy controls (then every slot); one that fails is lost (`node_failed`); one the agents find late
(silent for half the loss timeout) is probed ahead, so that the verdict is in when they name it. Where all answer,
the agents alone restart and the trainers go on (every store is intact), unless that fails or happened
ALONE_PER_LAUNCH times in the launch (`agent_failed`: relaunch); a step that ended before its agents were ready is
launched once more (`agents_again`): a Slurm hiccup at a step's start must not cost a relaunch."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future

from hpcft.errors import CheckpointError
from hpcft.launch.steps.agents import AgentSteps, StepEnded
from hpcft.launch.policy.layout import Layout
from hpcft.launch.node.nodecheck import NodeCheck
from hpcft.launch.policy.failures import Event, Kind, control_nodes

ALONE_PER_LAUNCH = 3  # agent restarts without the trainers in one launch before a relaunch instead


class AgentLoss:
    """Turns failed agents into a policy event, or into a restart of the agents alone (None: keep watching)."""

    def __init__(self, agents: AgentSteps, nodes: NodeCheck, emit: Callable[..., None],
                 interrupted: Callable[[], bool]):
        self.agents, self.nodes, self.emit, self.interrupted = agents, nodes, emit, interrupted
        self.alone = 0  # agent restarts without the trainers in the current launch
        self._ahead: tuple[frozenset[str], Future] | None = None  # the late nodes probed ahead, and the verdict

    def launched(self) -> None:
        """A new launch of the trainers: its own count of agent restarts, nothing probed ahead."""
        self.alone, self._ahead = 0, None

    def ahead(self, layout: Layout) -> None:
        """While the trainers run: probe the nodes the agents find late (event `agents_late`), unless they were while
        late; a verdict outlives no recovery (none late: it is dropped)."""
        late = self.agents.late(layout)
        if not late:
            self._ahead = None
        if not late or (self._ahead is not None and self._ahead[0] >= late.keys()):
            return
        self.emit("agents_late", tag=self.agents.tag, nodes=",".join(late), reason="; ".join(dict.fromkeys(
            late.values())), action="probed now, beside controls; lost only if the agents name it past the timeout")
        self._ahead = (frozenset(late), self.nodes.probe_ahead(list(late), control_nodes(list(layout.slots),
                                                                                         list(late))))

    def suspects_lost(self, layout: Layout, suspects: Mapping[str, str]) -> dict[str, str]:
        """The nodes among the agents' suspects (then among every slot, when they all answer) that fail the probe:
        the one probed ahead, if it covers them."""
        ahead, self._ahead = self._ahead, None
        bad = self.nodes.bad(list(suspects), probe=True, found_by="agents", suspected=suspects,
                             controls=control_nodes(list(layout.slots), list(suspects)),
                             ahead=ahead[1] if ahead is not None and ahead[0] >= suspects.keys() else None)
        if not bad and len(suspects) < len(layout.slots):
            bad = self.nodes.bad(layout.slots, probe=True, found_by="agents")
        return bad

    def while_training(self, layout: Layout, suspects: Mapping[str, str], restart_count: int,
                       env: Mapping[str, str]) -> Event | None:
        """Agents failed while the trainers run: `node_failed` for a lost node; else the agents restarted alone
        (None: the trainers go on, watched as before), or `agent_failed` when that cannot be done."""
        why = "; ".join(dict.fromkeys(suspects.values()))
        self.emit("agents_suspect", level=logging.WARNING, tag=self.agents.tag, nodes=",".join(suspects), reason=why,
                  action="probe")  # when the supervisor heard of it; node_bad or agents_failed says what it was
        bad = self.suspects_lost(layout, suspects)
        if bad:
            return Event.nodes_lost(bad)
        alone = self.alone < ALONE_PER_LAUNCH
        self.emit("agents_failed", level=logging.ERROR, tag=self.agents.tag, reason=why,
                  action="every node answers: the agents restart alone, the trainers keep training (unprotected "
                         "until the agents are ready)" if alone else
                         f"every node answers, but the agents were restarted alone {self.alone} times in this "
                         "launch: relaunch from memory with fresh agents (unprotected until then)")
        if not alone:
            return Event(Kind.AGENT_FAILED, detail=why)
        started, old = time.monotonic(), self.agents.tag
        self.agents.stop(ask=False, flush=False)
        self.alone += 1
        failure = self.agents.start(layout, restart_count, dict(env), tag=f"{restart_count}-alone{self.alone}")
        # the whole agents' step, never one agent: over MPI too, where the new step is a fresh MPI world
        self.emit("agents_restart", level=logging.INFO if failure is None else logging.ERROR, ok=failure is None,
                  tag=self.agents.tag, replaced=old, trainers="kept", seconds=round(time.monotonic() - started, 3),
                  transport=self.agents.cfg.protection.agent_transport, restarted="the agents' whole step",
                  **({"reason": str(failure), "action": "relaunch from memory"} if failure else {}))
        return None if failure is None else self.not_ready(layout, failure)

    def before_training(self, layout: Layout, failure: CheckpointError, restart_count: int,
                        env: Mapping[str, str]) -> Event | None:
        """The agents could not get ready before the trainers start: `not_ready`'s event, except that a step that
        ended on nodes which all answer is launched once more (None: that one is ready, the trainers may start).
        Not when srun itself was killed: its step's agents may still run, and two sets must never share a store."""
        event = self.not_ready(layout, failure)
        if event.kind is not Kind.AGENT_FAILED or not isinstance(failure, StepEnded) or (failure.exit_status or 0) < 0:
            return event
        old = self.agents.tag
        self.emit("agents_again", level=logging.WARNING, tag=old, reason=str(failure),
                  action="every node answers: the agents' step is launched once more before the trainers start")
        self.agents.stop(ask=False, flush=False)
        again = self.agents.start(layout, restart_count, dict(env), tag=f"{old}-again")
        return None if again is None else self.not_ready(layout, again)

    def not_ready(self, layout: Layout, exc: CheckpointError) -> Event:
        """Agents not ready: a bad node (suspects probed beside controls, else every slot), or an agent failure."""
        if self.interrupted():
            return Event(Kind.WALLTIME, detail="SIGTERM")
        named = self.agents.lost(layout) or {}  # the peers the agents' heartbeats named: probed as while training
        bad = self.agents.bad_nodes or (self.suspects_lost(layout, named) if 0 < len(named) < len(layout.slots)
                                        else self.nodes.bad(layout.slots, probe=True))
        if bad:
            return Event.nodes_lost(bad)
        return Event(Kind.AGENT_FAILED, detail=str(exc))
