"""What the supervisor does after something happens: a pure function of the event and the run's state, with no Slurm
and no clock of its own (`now` is passed in), so that every branch is tested with plain data."""
import enum
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from hpcft import events
from hpcft.launch.policy.layout import Layout, NoSpareError

# Exit status of `hpcft run` (also in docs/guide.md). EXIT_GAVE_UP means "do not requeue": put it in
# slurm.conf's RequeueExitHold or leave it out of RequeueExit.
EXIT_OK = 0
EXIT_ERROR = 1          # hpcft itself could not run (bad option, Slurm command failed): fix and resubmit
EXIT_GAVE_UP = 3        # failures beyond --max-restarts, or nothing left to run on: do not requeue
EXIT_REQUEUED = 4       # `scontrol requeue` was asked; the job runs again and resumes
EXIT_NO_REQUEUE = 5     # a requeue was needed but is not allowed (--no-requeue, or not a batch job)


class Kind(enum.Enum):
    SUCCESS = "success"                  # the step ended with every task at exit status 0
    TASK_FAILED = "task_failed"          # a task died or exited non-zero; its node answers
    NODE_FAILED = "node_failed"          # a node is DOWN/DRAIN/NOT_RESPONDING, left the allocation or failed a probe
    HANG = "hang"                        # no completed step within --hang-timeout
    WALLTIME = "walltime"                # Slurm's warning signal (SIGUSR1 from --signal=B:USR1@T)
    ALLOCATION_LOST = "allocation_lost"  # too few nodes left in the allocation to form the layout at all
    AGENT_FAILED = "agent_failed"        # a node agent failed or was not ready in time; its node answers
    STEP_REFUSED = "step_refused"        # Slurm would not create the step (its options do not fit the nodes)
    NODES_RETURNED = "nodes_returned"    # --elastic-grow: nodes of the allocation back in service (policy_grow)
    STRAGGLER = "straggler"              # --evict-stragglers: a slow node, its step protected (policy_straggler)


def hung(now: float, launched: float, last_step: float | None, hang_timeout: float,
         start_timeout: float = 0.0) -> str | None:
    """Why a launch counts as hung (--hang-timeout), or None: no completed step within `start_timeout` of the launch
    (`hang_timeout` when 0) while it has completed none (`last_step` None), else none within `hang_timeout` of the
    last one. Off when `hang_timeout` is 0."""
    if not hang_timeout:
        return None
    if last_step is None:
        quiet = now - launched
        return f"no completed step for {quiet:.0f} s since the launch" if quiet > (start_timeout or hang_timeout) \
            else None
    quiet = now - last_step
    return f"no completed step for {quiet:.0f} s" if quiet > hang_timeout else None


class Action(enum.Enum):
    DONE = "done"
    RELAUNCH = "relaunch"    # same nodes, same slots: each rank finds its snapshot in local memory
    REPLACE = "replace"      # spares take the failed nodes' slots, then relaunch
    SHRINK = "shrink"        # --elastic, no spare left: continue on the surviving nodes, resharded
    GROW = "grow"            # --elastic-grow: a shrunk job takes returned nodes back, resharded
    EVICT = "evict"          # --evict-stragglers: a spare takes a slow (healthy) node's slot, then relaunch
    REQUEUE = "requeue"      # persist and `scontrol requeue`: resume in a new allocation
    STOP = "stop"            # give up, with a summary


@dataclass(frozen=True)
class Event:
    kind: Kind
    exit_code: int | None = None
    bad_nodes: tuple[str, ...] = ()
    failed_tasks: tuple[str, ...] = ()   # srun's own words, e.g. "n2: task 1: Exited with exit code 3"
    detail: str = ""
    returned: tuple[str, ...] = ()       # NODES_RETURNED: the nodes to take back, as policy_grow chose them
    closed: tuple[str, ...] = ()         # those of bad_nodes that are alive (drained…): their agents still work

    @property
    def lost_nodes(self) -> tuple[str, ...]:
        """The bad nodes that are gone (their agents with them): the mesh is broken only when one is."""
        return tuple(n for n in self.bad_nodes if n not in self.closed)

    @classmethod
    def nodes_lost(cls, bad: Mapping[str, str], exit_code: int | None = None,
                   closed: Iterable[str] = ()) -> "Event":
        """NODE_FAILED for {node: why}, each named in the detail; `closed`: those Slurm only closed."""
        return cls(Kind.NODE_FAILED, exit_code=exit_code, bad_nodes=tuple(bad),
                   detail="; ".join(f"{n}: {w}" for n, w in bad.items()), closed=tuple(n for n in closed if n in bad))


@dataclass(frozen=True)
class State:
    layout: Layout
    restarts: int = 0                 # relaunches so far in this job (all allocations)
    max_restarts: int = 3
    requeue_allowed: bool = True
    end_time: float | None = None     # the allocation's end (epoch seconds), None if unlimited
    requeue_margin: float = 300.0
    min_nodes: int | None = None      # --elastic: shrink down to this many active nodes (None: never shrink)


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    layout: Layout
    exit_code: int | None = None                       # for DONE / REQUEUE / STOP: what `hpcft run` returns
    replaced: dict[str, str] = field(default_factory=dict)


def requeue_or_stop(state: State, reason: str) -> Decision:
    """Requeue where allowed, else stop: what a run does that cannot go on in this allocation."""
    if state.requeue_allowed:
        return Decision(Action.REQUEUE, reason, state.layout, EXIT_REQUEUED)
    return Decision(Action.STOP, f"{reason}; requeue not allowed", state.layout, EXIT_NO_REQUEUE)


def decide(event: Event, state: State, now: float) -> Decision:
    """Relaunch on the same nodes, replace failed nodes by spares, requeue, or stop — and why."""
    if event.kind is Kind.SUCCESS:
        return Decision(Action.DONE, "every task exited 0", state.layout, EXIT_OK)
    if event.kind is Kind.WALLTIME:
        return requeue_or_stop(state, "walltime warning signal")
    if event.kind is Kind.ALLOCATION_LOST:
        return requeue_or_stop(state, f"allocation lost ({event.detail or 'too few nodes'})")
    if event.kind is Kind.STEP_REFUSED:  # the same options would be refused again: a relaunch cannot help
        return Decision(Action.STOP, f"Slurm refused to create the step: {event.detail}; fix the options "
                        "(--tasks-per-node, --profile, --srun-args) and resubmit", state.layout, EXIT_ERROR)
    if event.kind is Kind.NODES_RETURNED:  # not a failure: no restart is counted against --max-restarts
        grown = state.layout.grow(event.returned)
        return Decision(Action.GROW, f"node(s) {','.join(event.returned)} back in service ({event.detail}); "
                        f"--elastic-grow: continue on {len(grown.slots)} node(s) ({','.join(grown.slots)}), "
                        "resharded", grown)
    if event.kind is Kind.STRAGGLER:  # no failure: not counted against --max-restarts (the watch checks the budget)
        try:
            layout, replaced = state.layout.replace(list(event.bad_nodes))
        except NoSpareError:
            return Decision(Action.RELAUNCH, f"straggler {event.detail}, but no spare is left: relaunch on the same "
                            "nodes", state.layout)
        moves = ", ".join(f"{a}->{b}" for a, b in replaced.items())
        return Decision(Action.EVICT, f"straggler {event.detail}: a spare takes its slot ({moves}), the node is "
                        "retired from this run's slots", layout, replaced=replaced)
    if state.restarts >= state.max_restarts:
        return Decision(Action.STOP, f"{event.kind.value} after {state.restarts} restart(s), the limit "
                        f"(--max-restarts {state.max_restarts})", state.layout, EXIT_GAVE_UP)
    layout, replaced, why, shrink = state.layout, {}, event.kind.value, ""
    bad = _leaving(state.layout, event)
    kept = [n for n in event.bad_nodes if n not in bad]  # closed, with no spare for them: they keep their slots
    if bad:
        try:
            layout, replaced = state.layout.replace(list(bad))
        except NoSpareError as exc:
            shrunk = state.layout.shrink(bad)
            if state.min_nodes is None or len(shrunk.slots) < state.min_nodes:
                excluded = tuple(dict.fromkeys(state.layout.excluded + bad))
                floor = "" if state.min_nodes is None else \
                    f"; {len(shrunk.slots)} node(s) left, fewer than --min-nodes {state.min_nodes}"
                return requeue_or_stop(replace(state, layout=replace(state.layout, excluded=excluded)),
                                       str(exc) + floor)
            layout, shrink = shrunk, str(exc)
        why = f"{why} on {','.join(bad)}"
    if kept:
        why = (f"{why}; closed node(s) {','.join(kept)} keep their slots: no spare is left for them, and they still "
               "run the job (Slurm leaves them out of the next allocation)")
    # Near the end of the walltime a relaunch would not get far: requeue, if that is possible at all.
    if state.requeue_allowed and state.end_time is not None and state.end_time - now < state.requeue_margin:
        left = max(0.0, state.end_time - now)
        return requeue_or_stop(replace(state, layout=layout),
                        f"{why} with {left:.0f} s of walltime left (< --requeue-margin {state.requeue_margin:g} s)")
    if shrink:
        return Decision(Action.SHRINK, f"{why}: {shrink}; --elastic: continue on {len(layout.slots)} of "
                        f"{len(state.layout.slots)} node(s) ({','.join(layout.slots)}), resharded", layout)
    if replaced:
        moves = ", ".join(f"{a}->{b}" for a, b in replaced.items())
        return Decision(Action.REPLACE, f"{why}: spare takes the slot ({moves})", layout, replaced=replaced)
    return Decision(Action.RELAUNCH, f"{why}: {'no node lost' if kept else 'nodes healthy'}, relaunch on the same "
                    "nodes", layout)


def _leaving(layout: Layout, event: Event) -> tuple[str, ...]:
    """The event's bad nodes to take out of the slots: every lost one, and a closed one (drained, a reboot asked for:
    it still runs the job) only while a spare is left for it once the lost ones have theirs; a closed node that
    keeps its slot beats a shrink or a requeue."""
    lost = event.lost_nodes
    free = sum(s not in event.bad_nodes for s in layout.spares) - sum(n in layout.slots for n in lost)
    closed = [n for n in event.bad_nodes if n in event.closed and n in layout.slots]
    return lost + tuple(closed[:max(0, free)])


def stale_signal(*, requeued_run: bool, progressed: bool, time_left: float | None, margin: float) -> str | None:
    """Why a SIGUSR1 must not requeue this run, or None to act on it. Slurm signals a batch step by job id alone, so a
    late or retried delivery of the signal a previous run acted on lands in the requeued run, known by what cannot be
    true of a real one: a requeued run with no step completed (a requeue saves nothing) and over `margin` s left."""
    if not requeued_run or progressed:
        return None
    if time_left is not None and time_left <= margin:
        return None
    left = "unlimited" if time_left is None else f"{time_left:.0f} s"
    return (f"requeued run has completed no step yet and has {left} of walltime left (> --requeue-margin "
            f"{margin:g} s): a late delivery of the signal the previous run acted on")


def record(decision: Decision, event: Event, state: State, job_dir: str) -> dict:
    """One greppable `event=decision action=…` line and its JSON record in the job directory's events.jsonl
    (`hpcft run` shows INFO events, so a done or relaunch decision is in the job output too)."""
    level = logging.INFO if decision.action in (Action.DONE, Action.RELAUNCH) else logging.WARNING
    return events.emit(
        "decision", level=level, log_dir=job_dir, action=decision.action.value, cause=event.kind.value,
        reason=decision.reason, restarts=state.restarts, exit_code=event.exit_code,
        bad_nodes=",".join(event.bad_nodes), failed_tasks="; ".join(event.failed_tasks),
        replaced=",".join(f"{a}:{b}" for a, b in decision.replaced.items()),
        slots=",".join(decision.layout.slots), spares=",".join(decision.layout.spares),
        excluded=",".join(decision.layout.excluded), result=decision.exit_code,
        **({"nodes_from": len(state.layout.slots), "nodes_to": len(decision.layout.slots)}
           if decision.action in (Action.SHRINK, Action.GROW) else {}))


CONTROLS = 3             # healthy-looking nodes probed beside the agents' suspects, to time a healthy answer
CONTROL_FACTOR = 4.0     # a suspect is given this many times the controls' slowest answer ...
CONTROL_FLOOR_S = 1.0    # ... and at least this long


def probe_deadline(timeout: float, controls: list[float] | None) -> float:
    """When (s after the probe's start) a silent node is bad: `timeout`, or once half the controls answered
    (`controls`: their times) CONTROL_FACTOR × the slowest, at least CONTROL_FLOOR_S: the controls share the suspect's
    cluster and load, and a node silent past --loss-timeout that answers so much later than its peers is not
    answering."""
    if not controls:
        return timeout
    return min(timeout, max(CONTROL_FLOOR_S, CONTROL_FACTOR * max(controls)))


def control_nodes(slots: list[str], suspects: list[str], count: int = CONTROLS) -> list[str]:
    """Up to `count` non-suspect slots, the suspects' neighbours first: spread over the job, not its first nodes."""
    others = [n for n in slots if n not in suspects]
    if not others or not suspects:
        return others[:count]
    first = min((slots.index(s) for s in suspects if s in slots), default=0)
    return sorted(others, key=lambda n: (abs(slots.index(n) - first), slots.index(n)))[:count]
