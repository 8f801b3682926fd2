"""The elastic shrink (`--elastic`: a node lost, no spare, at least --min-nodes left): agents start in the OLD layout,
each lost slot's on a survivor (`--hosted`) rebuilding it from parity as a spare would; they flush that step to the
durable tier (any world size reads it); the stores are wiped (a smaller world numbers ranks differently) and the
trainers reshard on N-1 nodes. A failure becomes the requeue it replaced. The grow (`--elastic-grow`) flushes, wipes and
relaunches on more nodes, or on the same ones from memory if its flush fails."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from hpcft.elastic import ENV_BASE_WORLD, ENV_BATCH
from hpcft.launch.steps.agents import AgentSteps
from hpcft.launch.config.model import RunConfig
from hpcft.launch.node.janitor import Janitor
from hpcft.launch.policy.layout import Layout
from hpcft.launch.policy.failures import Action, Decision, Event, State, record, requeue_or_stop


def hosts(old: Layout, lost: Sequence[str]) -> dict[int, str]:
    """{slot of each lost node: the survivor that hosts its agent}: the next surviving slot after it (wrapping),
    so that two lost slots land on different survivors where there are enough (pure)."""
    gone = set(lost)
    survivors = [i for i, n in enumerate(old.slots) if n not in gone]
    if not survivors:
        raise ValueError("no surviving node to host the lost slots")
    out: dict[int, str] = {}
    for k in (i for i, n in enumerate(old.slots) if n in gone):
        after = [i for i in survivors if i > k] + [i for i in survivors if i < k]
        free = [i for i in after if old.slots[i] not in out.values()]
        out[k] = old.slots[(free or after)[0]]
    return out


def shrunk_config(cfg: RunConfig, active: int) -> RunConfig:
    """`cfg` (the run's starting one) for `active` nodes: --nodes follows, protection sets no larger than the nodes
    left (a partner copy on a single node, or a set of one, protects nothing: none)."""
    cfg = cfg.but(nodes=active)
    if active < 2:
        return cfg.but(protect="none")
    if cfg.protection.protect in ("xor", "rs") and cfg.protection.group > active:
        return cfg.but(group=active, losses=min(cfg.protection.losses, active - 1))
    if cfg.protection.protect == "partner" and cfg.protection.distance % active == 0:
        return cfg.but(distance=1)
    return cfg


def trainer_env(cfg: RunConfig, base_world: int) -> dict[str, str]:
    """What the trainers need to keep their batch arithmetic across a shrink (`hpcft.elastic.batch_plan`)."""
    return {ENV_BATCH: cfg.elastic.elastic_batch, ENV_BASE_WORLD: str(base_world)} if cfg.elastic.elastic else {}


@dataclass(frozen=True)
class Outcome:
    """What a shrink achieved: the step the lost slots were rebuilt at and that is now durable, or why not."""
    durable: int | None
    protected: int | None
    error: str | None

    @property
    def ok(self) -> bool:
        return self.error is None and self.durable is not None and self.durable == self.protected


class Reshaper:
    """Carries out a `shrink` or `grow` decision with the job's agents and janitor (the module doc); `emit` records."""

    def __init__(self, cfg: RunConfig, agents: AgentSteps, janitor: Janitor, emit: Callable[..., None]):
        self.cfg, self.agents, self.janitor, self.emit = cfg, agents, janitor, emit

    def carry_out(self, decision: Decision, event: Event, state: State, env: Mapping[str, str], tag: str,
                  job_dir: str) -> tuple[Decision, str | None]:
        """(the decision, or what replaces it when the shrink or grow failed; the line for the run's summary)."""
        old, new = state.layout, decision.layout
        if decision.action is Action.GROW:
            out = self.grow(old, new, env)
            if out.ok:
                return decision, (f"back on {len(new.slots)} nodes ({','.join(event.returned)} returned) from step "
                                  f"{out.durable}, resharded from the durable tier")
            failed = Decision(Action.RELAUNCH, f"{decision.reason}; the grow failed: {out.error}; relaunch on the "
                              f"same {len(old.slots)} node(s)", old)
            record(failed, event, state, job_dir)
            return failed, f"grow to {len(new.slots)} nodes failed: {out.error}"
        out = self.shrink(old, new, event.bad_nodes, env, tag)
        if not out.ok:
            failed = requeue_or_stop(replace(state, layout=replace(old, excluded=new.excluded)),
                                     f"{decision.reason}; the shrink failed: {out.error}")
            record(failed, event, state, job_dir)
            return failed, None
        return decision, (f"continues on {len(new.slots)} of {len(old.slots)} nodes ({','.join(event.bad_nodes)} "
                          f"lost) from step {out.durable}, resharded from memory+parity, no protected step lost")

    def shrink(self, old: Layout, new: Layout, lost: Sequence[str], env: Mapping[str, str], tag: str) -> Outcome:
        """Steps 1–3 of the module doc; on success the survivors' memory is wiped and the trainers may start."""
        started = time.monotonic()
        hosted = hosts(old, lost)
        failure = self.agents.start(old, 1, env, hosted=hosted, tag=tag)
        if failure is not None:
            outcome = Outcome(None, None, f"the lost slot(s) could not be rebuilt on the survivors: {failure}")
        else:
            durable, error = self.agents.flush(time.monotonic() + self.cfg.protection.protect_timeout)
            outcome = Outcome(durable, self.agents.protected(), error)
        self.agents.stop(ask=failure is None)
        outcome = self._wipe(outcome, new, env)
        self.emit("shrink", level=logging.WARNING if outcome.ok else logging.ERROR, ok=outcome.ok,
                  nodes_from=len(old.slots), nodes_to=len(new.slots), lost=",".join(lost),
                  hosted=",".join(f"{k}:{n}" for k, n in hosted.items()), step=outcome.protected,
                  durable=outcome.durable, seconds=round(time.monotonic() - started, 3),
                  source="memory+parity" if outcome.ok else None, **({"error": outcome.error} if outcome.error else {}))
        return outcome

    def grow(self, old: Layout, new: Layout, env: Mapping[str, str]) -> Outcome:
        """With the trainers stopped, `old`'s agents persist the newest step, then every node of `new` is wiped (a
        returned node's memory is stale); on failure nothing is wiped, so `old` relaunches from its memory."""
        started = time.monotonic()
        protected, durable, error = self.agents.persist()
        self.agents.stop()
        outcome = self._wipe(Outcome(durable, protected, error), new, env)
        self.emit("grow", level=logging.WARNING if outcome.ok else logging.ERROR, ok=outcome.ok,
                  nodes_from=len(old.slots), nodes_to=len(new.slots),
                  returned=",".join(n for n in new.slots if n not in old.slots), step=outcome.protected,
                  durable=outcome.durable, seconds=round(time.monotonic() - started, 3),
                  source="durable" if outcome.ok else None, **({"error": outcome.error} if outcome.error else {}))
        return outcome

    def _wipe(self, outcome: Outcome, new: Layout, env: Mapping[str, str]) -> Outcome:
        """Wipe `new`'s nodes after a good flush: memory in the old layout would only mislead a restore in the new."""
        if not outcome.ok:
            return outcome if outcome.error else replace(
                outcome, error=f"the durable step {outcome.durable} is not the protected one {outcome.protected}")
        code = self.janitor.wipe(list(new.slots), env)
        if code != 0:
            return replace(outcome, error=f"the stores could not be wiped (janitor exit {code})")
        return outcome
