"""The node agent: join the mesh, rebuild what replaced nodes lost (after a relaunch), then protect the newest step
every node holds, round after round, publishing its status. No state of its own: everything is read from the store."""
from __future__ import annotations

import logging
import operator
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterable
from functools import partial
from pathlib import Path

from hpcft import events, nodemem
from hpcft.agent import status
from hpcft.agent.transport import uplink
from hpcft.agent.transport.autogroup import Below
from hpcft.agent.protection.budget import LagBudget, at_trainers_priority, foreseen_lag, pause
from hpcft.agent.protection.bundle import (Bundle, both, by_rank, complete_steps, local_versions, owned,
                                          pin_targets, release_others)
from hpcft.agent.transport.heartbeat import Heartbeat, PeerSilent
from hpcft.agent.transport.link import COUNT
from hpcft.agent.transport.mesh import Mesh, MeshBase
from hpcft.agent.protection.flush import Flusher
from hpcft.agent.protection.pins import Pins
from hpcft.agent.protection.placement import Placement, Scheme, plan
from hpcft.agent.protection.protect import Record, StaleStep, drop_orphans, protect_dir, protect_step, records
from hpcft.agent.transport.rendezvous import Rendezvous, join
from hpcft.agent.settings import AgentConfig
from hpcft.agent.protection.rebuild import rebuild
from hpcft.agent.transport.throttle import chore, cpu_cores
from hpcft.errors import HpcftError, IntegrityError, NoCheckpointError
from hpcft.store import job_dir, resolve_root, secure_dir, pin as store_pin, writer
from hpcft.store.owner import Owner, adoption

_log = logging.getLogger(__name__)
STEPS = [COUNT]  # what an agreement on steps carries (link.mismatch): a peer's malformed list is its TransportError
LATE_VERDICT_POLL_S = 0.05  # how often a failing agent looks for its heartbeat's verdict on a late peer (_silence)


def protect_newest(mesh: MeshBase, placement: Placement, job: Path, pins: Pins, keep: int = 2,
                   failed: set[int] | None = None, ranks: Collection[int] | None = None) -> Record | None:
    """One collective round: protect the newest step complete on every node and not yet protected everywhere, pinned
    for the pass; None if there is none, or a node's copy was reused before the pin or is damaged (with an event).
    `failed`: the steps whose pass found that (the same set on every agent), not tried again while they are held:
    a damaged copy pinned round after round would also keep a relaunched trainer's restore from withdrawing it.
    `ranks`: the node's (`complete_steps`)."""
    started = time.perf_counter()
    failed = set() if failed is None else failed
    complete = complete_steps(job, ranks=ranks)
    held = mesh.allreduce(sorted(complete), both, STEPS)  # held everywhere: log2 N messages of one list each
    done = mesh.allreduce(sorted(records(job)), both, STEPS)
    failed &= set(held)
    # the newest `keep` steps held everywhere (the records kept): an older one would be retired right after its
    # pass and protected again the next round, forever
    todo = sorted(set(held[-keep:]) - set(done) - failed)
    if not todo:
        return None
    step = todo[-1]
    bundle = Bundle(step, complete[step])
    try:
        with pins.holding(bundle.pin_targets()):
            ok = _readable(bundle, mesh)
            if not mesh.allreduce(ok, operator.and_, bool):
                failed.add(step)
                return None
            rec = protect_step(mesh, placement, bundle, job, keep, started)
            pins.keep(bundle.pin_targets())  # held until a newer step is protected: a node loss finds this one
            return rec
    finally:
        bundle.close()


def _readable(bundle: Bundle, mesh: MeshBase) -> bool:
    """After pinning (the writer withdraws first, then checks the pin): is this node's copy still committed and
    intact? False with an event if not."""
    if not bundle.still_committed():
        events.emit("protect_missed", slot=mesh.slot, step=bundle.step,
                    reason="the trainers reused the slot before the agent pinned it")
        return False
    try:
        bundle.verify(mesh.throttle)
        return True
    except IntegrityError as exc:
        stale = not bundle.still_committed()  # only if a pin was broken (the agent stopped past its lease)
        events.emit("protect_stale" if stale else "protect_skipped", level=logging.WARNING if stale else logging.ERROR,
                    step=bundle.step, slot=mesh.slot, reason="the trainers reused the slot" if stale else str(exc))
        return False


def keep_newest_protected(mesh: MeshBase, job: Path, pins: Pins,
                          ranks: Collection[int] | None = None) -> int | None:
    """At start (collective): keep pinned the newest step every node holds and has a record of, as a pass would have,
    so resuming trainers do not recycle it; agreed, as a record of a step a lost peer never committed guards nothing."""
    complete, recs = complete_steps(job, ranks=ranks), records(job)
    everywhere = mesh.allreduce(sorted(set(complete) & set(recs)), both, STEPS)
    if not everywhere:
        return None
    pins.keep(pin_targets(everywhere[-1], complete[everywhere[-1]]))
    return everywhere[-1]


def protection_lag(complete: dict[int, dict], protected: Iterable[int]) -> tuple[int | None, float | None]:
    """How far protection trails the trainers here: (steps, seconds between the two snapshots), None where nothing
    is protected (or a snapshot's time is unknown, as a protected step the trainers no longer hold: the lag counts
    from it all the same, else a stall behind a recycled step would read as none)."""
    guarded = max(protected, default=None)
    if not complete or guarded is None:
        return None, None
    newest = max(complete)
    a = _taken(complete, newest)
    b = _taken(complete, guarded) if guarded in complete else None
    return max(0, newest - guarded), None if a is None or b is None else round(max(0.0, a - b), 3)


def _taken(complete: dict[int, dict], step: int) -> float | None:
    """When the snapshot of `step` was taken (its manifest's time), if known."""
    t = next(iter(complete[step].values())).manifest.get("time")
    return float(t) if isinstance(t, (int, float)) else None


def step_seconds(complete: dict[int, dict]) -> float | None:
    """The trainers' pace: seconds per step between this node's two newest snapshots, if known."""
    steps = sorted(complete)[-2:]
    if len(steps) < 2:
        return None
    a, b = _taken(complete, steps[0]), _taken(complete, steps[1])
    return None if a is None or b is None or b <= a else (b - a) / (steps[1] - steps[0])


def _watch_requests(requests: status.Requests, mesh: MeshBase, below: Below, drained: threading.Event,
                    wake: threading.Event, poll: float = 0.2) -> None:
    """Until the supervisor asks for a stop (then SIGTERM to this process, which unwinds the agent cleanly): once it
    asks for a drain (a persist: the trainers wait), lift the caps, a sleep under way included, give the agent the
    trainers' priority, and wake the round loop; a new flush request wakes it too (a persist waits for that flush)."""
    flush = requests.flush()
    while not requests.stop():
        if not drained.is_set() and requests.drain():
            mesh.throttle.release()
            below.level()
            events.emit("agent_drain", tag=requests.tag)
            drained.set()
            wake.set()
        if (asked := requests.flush()) != flush:
            flush = asked
            wake.set()
        time.sleep(poll)
    os.kill(os.getpid(), signal.SIGTERM)


def _steer(budget: LagBudget, mesh: MeshBase, below: Below, cfg: AgentConfig, lag: int | None) -> bool:
    """Set the next round's CPU cap from the foreseen `lag` (events `protect_budget`, `protect_lag_unmet`); over the
    bound (True) the bound beats the cap: the CPU spent so far is forgiven, the next round starts at once, and the
    agent runs at the trainers' priority until the lag is back within the bound."""
    cap, unmet = budget.update(lag)
    over = lag is not None and lag > budget.bound
    if over:
        mesh.throttle.forgive()
    if at_trainers_priority(over, persisting=False):
        below.level()
    else:
        below.below()
    if cap != mesh.throttle.cpu:
        mesh.throttle.cpu = cap
        events.emit("protect_budget", slot=cfg.slot, cores=round(cap, 4), lag=lag, bound=cfg.lag_bound)
    if unmet:
        events.emit("protect_lag_unmet", level=logging.WARNING, slot=cfg.slot, lag=lag, bound=cfg.lag_bound,
                    cores=round(cap, 4), advice="the agent's CPU at its lag_cores cannot keep protection within the "
                    "bound on this node: raise lag_cores or the bound, or protect with a cheaper scheme")
    return over


def _listen_for_silence(cfg: AgentConfig, mesh: MeshBase, meet: Rendezvous, node: str, wake: threading.Event,
                        late: Callable[[list[int]], None]) -> Heartbeat | None:
    """Heartbeats with the overlay neighbours (none with --loss-timeout 0 or one agent); a silent or closed one (event
    `peer_silent` / `peer_closed`) shuts the mesh down and wakes the round loop, which fails naming it (`_silence`);
    the late ones go to `late` (the report's `late_peers`)."""
    if cfg.loss_timeout <= 0 or cfg.slots < 2:
        return None

    def named(kind: str, **fields) -> None:
        events.emit(kind, level=logging.WARNING, slot=cfg.slot, node=node, **fields)
        mesh.abort()
        wake.set()

    return Heartbeat(cfg.slot, cfg.slots, cfg.secret, meet, timeout=cfg.loss_timeout,
                     on_silent=lambda peer, seconds: named("peer_silent", peer_slot=peer, silent_s=seconds,
                                                           loss_timeout=cfg.loss_timeout),
                     on_closed=lambda peer: named("peer_closed", peer_slot=peer, reason="its heartbeat connection "
                                                  "closed without a goodbye (the agent was killed or crashed)"),
                     on_late=late,
                     stopping=status.stop_path(cfg.rendezvous, cfg.tag).exists, host=cfg.host, bind=cfg.bind,
                     tag=cfg.tag, join_timeout=cfg.timeout)


def _silence(beat: Heartbeat | None) -> PeerSilent | None:
    """The failure to report when a peer went silent: naming it rather than whichever connection the abort broke.
    With a peer late and none named yet, the break is likely another agent's abort over that peer: this one's own
    verdict on it is due within the loss timeout, and is waited for (else a healthy aborting peer is named)."""
    if beat is None:
        return None
    deadline = time.monotonic() + beat.timeout
    while beat.suspect is None and beat.late and time.monotonic() < deadline:
        time.sleep(LATE_VERDICT_POLL_S)
    if beat.suspect is None:
        return None
    peer, seconds = beat.suspect
    err = PeerSilent(f"the agent of slot {peer} closed its heartbeat connection without a goodbye (killed or crashed)"
                     if beat.cause == "closed" else
                     f"the agent of slot {peer} was silent for {seconds:g} s (loss timeout {beat.timeout:g} s)")
    err.peer_slot = peer
    return err


def _mesh(cfg: AgentConfig, meet: Rendezvous, peers: Collection[int]) -> MeshBase:
    """The mesh over the configured transport: TCP channels met through `meet`, or an MPI communicator."""
    kw = {"rate": cfg.rate, "cpu": cpu_cores(cfg.cpu_share, cfg.cpu_cores), "timeout": cfg.timeout, "peers": peers}
    if cfg.transport == "mpi":
        from hpcft.agent.transport.mpimesh import MpiMesh  # mpi4py only where asked for

        return MpiMesh(cfg.slot, cfg.slots, host=cfg.host, **kw)
    return Mesh(cfg.slot, cfg.slots, cfg.secret, meet, host=cfg.host, bind=cfg.bind, tag=cfg.tag, **kw)


def _flush_round(flusher: Flusher, mesh: MeshBase, complete: dict[int, dict], recs: Iterable[int], scheme: Scheme,
                 owner: Owner) -> None:
    """The flush's collective step over the node's complete steps and records, this job's own steps only."""
    mine = owned(complete, owner)
    flusher.round(mesh, mine, sorted(recs if scheme.name != "none" else mine))


class Stopped(BaseException):
    """SIGTERM: the supervisor or Slurm stops the agents. Not an HpcftError: it unwinds the agent through its cleanup,
    and being asked to stop is no failure."""


def run(cfg: AgentConfig) -> int:
    """The agent's life: mesh, optional rebuild, protection rounds; 0 when the rounds are done."""
    placement = plan(cfg.slots, cfg.scheme)
    below = Below(cfg.nice)  # yield the cores to the trainers: protection is background work
    below.below()
    floor = cpu_cores(cfg.cpu_share, cfg.cpu_cores)
    cpu = {"cpu_budget": floor, "cpu_ceiling": max(floor, cfg.lag_cores) if cfg.lag_bound else floor,
           "cpu_set": len(os.sched_getaffinity(0))}  # the budget, its ceiling, and the cores it may run on
    events.emit("agent_cpu", level=logging.WARNING if floor > cpu["cpu_set"] else logging.INFO, slot=cfg.slot,
                cores=floor, may_run_on=cpu["cpu_set"], **below.said(),
                **({"advice": "the agent's step has fewer cores than its budget: give it the node's CPUs "
                              "(--cpus-per-task), or lower --agent-cores"} if floor > cpu["cpu_set"] else {}))
    job = secure_dir(job_dir(resolve_root(cfg.root), cfg.job_id))
    # one agent per node and job, for the process's life: a relaunch's waits here for its predecessor, killed with
    # its step and maybe still writing a record, to exit
    writer.claim(protect_dir(job))
    store_pin.announce(job)  # trainers opening their stores from now on keep a spare slot for the pins
    # data files a killed pass left without a record; no record is retired by count here: after passes that failed
    # their barrier, the newest step protected on every node may be older than this node's two newest records
    drop_orphans(protect_dir(job))
    node, mine = socket.gethostname(), cfg.ranks  # the ranks whose snapshots this node protects
    up = uplink.from_env(cfg.secret, tag=cfg.tag, slot=cfg.slot, node=node, job=None if cfg.root else job)
    publish = up.status if up is not None else partial(status.write, cfg.rendezvous, cfg.tag, cfg.slot)
    requests = status.Requests(cfg.rendezvous, cfg.tag, (lambda: up.orders) if up is not None else None)

    flusher: Flusher | None = None
    mesh: MeshBase | None = None
    beat: Heartbeat | None = None
    said = ""  # the phase reported last
    drained, wake = threading.Event(), threading.Event()
    guarded, behind_since = None, time.time()  # the newest protected step; since when it trails without advancing

    def report(phase: str, **fields) -> None:
        nonlocal said, guarded, behind_since
        said = phase
        versions = local_versions(job)
        complete, recs, held = complete_steps(job, versions, mine), records(job), by_rank(versions, mine)
        lag_steps, lag_s = protection_lag(complete, recs)
        newest = max(recs) if recs else None
        if newest != guarded or not lag_steps:  # advanced, or nothing newer staged: no stall (`hpcft status`)
            guarded, behind_since = newest, time.time()
        publish(node=node, phase=phase, scheme=cfg.scheme.name, group=cfg.scheme.group, losses=cfg.scheme.losses,
                distance=cfg.scheme.distance, slots=cfg.slots, interval=cfg.interval,
                staged=max(complete) if complete else None, protected=newest,
                persisted=flusher.durable if flusher else None, flushed_request=flusher.served if flusher else None,
                flushing=flusher.busy if flusher else False, flush_error=flusher.last_error if flusher else None,
                flush_phase=flusher.phase if flusher else None, local=flusher.local_step if flusher else None,
                cpu_cores=mesh.throttle.cpu if mesh else None, addr=mesh.address if mesh else None,
                ranks={str(r): max(v) for r, v in held.items()},
                versions={str(r): sorted(v) for r, v in held.items()}, staged_steps=sorted(complete),
                protected_steps=sorted(recs), lag_steps=lag_steps, lag_s=lag_s, behind_since=behind_since,
                lag_bound=cfg.lag_bound, drained=drained.is_set(), late_peers=beat.late if beat else [], **cpu,
                **below.said(), **nodemem.figures(job), **fields)

    report(status.REBUILDING if cfg.rebuild else status.READY)
    meet = join(cfg.secret, cfg.rendezvous, slot=cfg.slot, tag=cfg.tag, host=cfg.host, bind=cfg.bind,
                timeout=cfg.timeout)
    try:
        mesh = _mesh(cfg, meet, placement.exchange_peers(cfg.slot))
    except BaseException:
        meet.close()
        raise
    pins = Pins(f"agent slot {cfg.slot}", cfg.pin_lease)
    flusher = Flusher(cfg.persist, job, cfg.job_id, cfg.slot, pins, requests.flush, wake.set)
    budget = LagBudget(floor, cpu["cpu_ceiling"], cfg.lag_bound) if cfg.lag_bound else None
    owner = Owner(cfg.job_id, adopt=adoption())  # whose steps the flush may write under this job's name

    def late(peers: list[int]) -> None:
        """Told by the beat thread, sent at once: the round loop may be blocked on the late peer (no uplink: no probe
        ahead, the supervisor probes once the peer is named lost)."""
        if up is not None:
            up.amend(late_peers=peers)

    def stopping() -> None:
        """Asked to stop: no second SIGTERM may cut the cleanup or the last report short; "stopped" is said once."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if said != status.STOPPED:
            report(status.STOPPED)

    chore(_watch_requests, requests, mesh, below, drained, wake, name="hpcft-agent-requests").start()
    try:
        beat = _listen_for_silence(cfg, mesh, meet, node, wake, late)
        extra = {}
        with mesh.throttle.uncapped():  # the trainers wait for this: no cap, and none of it billed to the rounds
            if cfg.rebuild:
                try:
                    outcome = rebuild(mesh, placement, job, pins, cfg.job_id, cfg.root, mine)
                except NoCheckpointError as exc:
                    report(status.FAILED, reason="no_checkpoint", error=str(exc))
                    raise
                extra = {"rebuilt_step": outcome.step, "rebuilt": list(outcome.rebuilt)}
                print(f"slot={cfg.slot} rebuilt={outcome.step} here={cfg.slot in outcome.rebuilt}", flush=True)
            keep_newest_protected(mesh, job, pins, mine)
        report(status.READY, **extra)
        done, failed = 0, set()  # the steps a pass found damaged or reused on some node (protect_newest)
        while cfg.rounds <= 0 or done < cfg.rounds:
            if (silence := _silence(beat)) is not None:
                raise silence
            mesh.pace()  # the rounds' own CPU (all-gathers, status, manifest reads) counts against the cap
            rec, began = None, time.monotonic()
            if flusher.busy:  # first, so that a flush past the store frees it for this round's pass
                _flush_round(flusher, mesh, complete_steps(job, ranks=mine), records(job), cfg.scheme, owner)
            if not flusher.pinning and cfg.scheme.name != "none":  # the same on every agent (collective rounds)
                try:
                    rec = protect_newest(mesh, placement, job, pins, failed=failed, ranks=mine)
                except StaleStep as exc:  # after the exchange, so the mesh is still in step
                    events.emit("protect_stale", slot=cfg.slot, reason=str(exc))
                if rec is not None and mine is not None:
                    release_others(job, mine, rec.step, cfg.slot)
            complete, recs = complete_steps(job, ranks=mine), records(job)
            if not flusher.busy:  # then a new one when due, which sees this round's pass
                _flush_round(flusher, mesh, complete, recs, cfg.scheme, owner)
            lag, per_step, round_s = protection_lag(complete, recs)[0], step_seconds(complete), time.monotonic() - began
            over = budget is not None and not drained.is_set() and _steer(budget, mesh, below, cfg,
                                                                          foreseen_lag(lag, per_step, round_s))
            if drained.is_set():
                below.level()  # a drain that landed while this round was steered keeps the trainers' priority
            done += 1
            if up is None:  # under hpcft run the supervisor has it: no line per round in the job's agents log
                print(f"slot={cfg.slot} protected={rec.step if rec else None}", flush=True)
            report(status.PROTECTING, **extra)
            # draining or over the lag bound: rounds back to back while they protect; else until the interval, a drain
            if (cfg.rounds <= 0 or done < cfg.rounds) and (not (drained.is_set() or over) or rec is None):
                wake.wait(pause(cfg.interval, cfg.lag_bound, lag, per_step, round_s))
                wake.clear()
    except Stopped:
        stopping()
        raise
    except HpcftError as exc:
        if status.stop_path(cfg.rendezvous, cfg.tag).exists():  # a peer that stopped first closed the mesh
            stopping()  # before our own SIGTERM (_watch_requests) lands in the cleanup
            raise Stopped from exc
        silence = _silence(beat) if not isinstance(exc, NoCheckpointError) else None
        failure = exc if silence is None or isinstance(exc, PeerSilent) else silence
        if not isinstance(exc, NoCheckpointError):
            peer = getattr(failure, "peer_slot", None)  # a lost peer: its node is the supervisor's first suspect
            heard = {} if silence is None else {"silent_s": beat.suspect[1], "found_by": f"heartbeat ({beat.cause})"}
            report(status.FAILED, reason="error", error=str(failure), **({} if peer is None else {"peer_slot": peer}),
                   **heard)
        if failure is not exc:
            raise failure from exc
        raise
    finally:
        if isinstance(sys.exc_info()[1], Stopped) and said != status.FAILED:
            stopping()  # a SIGTERM that landed in the handlers above, before their report; a failure said stays
        if beat is not None:
            beat.close()
        pins.close()
        mesh.close()
        meet.close()
    return 0
