"""The run loop of `hpcft run` as a state machine (`Supervisor.run`): start, launch (the steps, then the trainers
watched: their exit, the slots' nodes, progress over the network, the agents, SIGUSR1), decide (the policy's decision
carried out), launch again or finish. What outlives a requeue is in the ledger's state.json (launch/ledger.py)."""
import dataclasses
import functools
import getpass
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from hpcft import events
from hpcft.errors import ConfigError, HpcftError, SlurmError
from hpcft.launch import reshape as elastic, losses
from hpcft.launch.config import profiles
from hpcft.launch.steps import broadcast
from hpcft.launch.watch.grow import GrowWatch
from hpcft.launch.steps.agentloss import AgentLoss
from hpcft.launch.steps.agents import AgentSteps, agent_iface
from hpcft.launch.fabric.service import Fabric
from hpcft.durable.catalog import ENV_PERSIST
from hpcft.durable.local import ENV_LOCAL
from hpcft.launch.config.model import RunConfig
from hpcft.launch.config.resolve import check_paths, check_shape, copy_env, durable_dir
from hpcft.launch.node import succession
from hpcft.launch.node.janitor import JANITOR_STEP_NAME, Janitor, requeue_flag
from hpcft.launch.policy.layout import Layout, given_back
from hpcft.launch.ledger import Ledger
from hpcft.launch.state import RunState
from hpcft.launch.policy.failures import EXIT_ERROR, Action, Decision, Event, Kind, State, decide, record, stale_signal
from hpcft.launch.steps.preflight import Preflight
from hpcft.launch.node import gate
from hpcft.launch.node.nodecheck import NodeCheck
from hpcft.launch.node.srun import TRAIN_STEP_NAME, step_env, trainer_argv
from hpcft.launch.steps.standbys import STANDBY_STEP_NAME, Standbys
from hpcft.launch.steps.stop import StepStopper, stop_steps_left, tee
from hpcft.launch.watch.slurm import SlurmWatch
from hpcft.launch.watch.stragglers import StragglerWatch
from hpcft.slurm import state as slurmstate
from hpcft.slurm.nodelist import compress
from hpcft.slurm.runner import Runner

_log = logging.getLogger(__name__)
BESIDE_AFTER_S = 30.0  # a relaunch's agents start once every rank restored, or this long after the launch at the latest
RELAUNCHES = (Action.RELAUNCH, Action.REPLACE, Action.SHRINK, Action.GROW, Action.EVICT)  # what launches again


class Supervisor:
    """One `hpcft run`: everything it touches in Slurm goes through `runner`."""

    def __init__(self, cfg: RunConfig, command: Sequence[str], *, runner: Runner | None = None,
                 environ: Mapping[str, str] | None = None, python: str = sys.executable,
                 argv: Sequence[str] | None = None):
        self.cfg, self.command = cfg, list(command)
        self.argv = argv  # `hpcft run`'s arguments, which a successor runs again (None: it cannot)
        self.runner = runner or Runner()
        self.environ = dict(os.environ if environ is None else environ)
        self.python = python
        self.generation, self.replaces = succession.succeeds(self.environ)  # (0, "") but in a successor
        self.job_id = self.environ.get("SLURM_JOB_ID") or self.environ.get("SLURM_JOBID") or ""
        if not self.job_id:
            raise ConfigError("hpcft run must run inside a Slurm allocation (sbatch or salloc); "
                              "use `hpcft submit` to create one")
        self.profile = profiles.get(cfg.launch.profile)
        self.job_dir = Path(cfg.launch.job_dir or Path.cwd() / f"hpcft-{self.job_id}").resolve()
        check_paths(cfg, self.job_dir)  # before any step: a run that cannot write its directories is refused
        self._signal: int | None = None
        self._wake = threading.Event()
        self._started = time.time()
        self._launched = False  # whether the run got past its start checks (and may have changed the nodes' memory)
        self._requeued_run = False
        self._end_time: float | None = None
        self._job_goes_on = False  # Slurm's job outlives this supervisor (requeued, taken over), or Slurm ends it
        self._stopper = StepStopper(self.runner, self.job_id, cfg.launch.kill_grace, self.emit)
        self._stop_steps = self._stopper.stop
        self.janitor = Janitor(self.runner, self.job_dir, python, self._stop_steps)
        self.standbys = Standbys(self.runner, self.job_dir, python, cfg.standby.preload, self.environ, emit=self.emit,
                                 stop_steps=self._stop_steps, enabled=cfg.standby.standby)
        self._slurm_run = 0  # Slurm's restart count of this run
        self._site_env: dict[str, str] = {}  # what the preflight adds to the steps' environment
        self.nodes = NodeCheck(self.runner, self.job_id, self.environ, cfg.recovery.probe_timeout, self.emit)
        self.fabric = Fabric(self.job_dir, self.emit, alarm=self._wake.set)  # the nodes' progress and status
        self.ledger = Ledger(self.job_dir, self.emit, self.fabric)  # what the summary and the next run are owed
        self.agents = AgentSteps(lambda: self.cfg, self.runner, self.job_dir, python, emit=self.emit,
                                 stop_steps=self._stop_steps, interrupted=self._terminated, view=self.fabric.view,
                                 order=self.fabric.order,
                                 check_nodes=lambda layout, probe, until: self.nodes.bad(
                                     layout.slots, probe=probe, closed=False, until=until))
        self.agent_loss = AgentLoss(self.agents, self.nodes, self.emit, self._terminated)
        self.reshaper = elastic.Reshaper(cfg, self.agents, self.janitor, self.emit)
        self.base_world = 0  # the world size this run started with (the trainers' batch arithmetic after a shrink)
        self.base_cfg = cfg  # the configuration this run started with (a shrunk or grown job's is sized from it)
        self.grow_watch = GrowWatch(cfg, self.runner, self.job_id, self.nodes, self.emit)
        self.stragglers = StragglerWatch(cfg, self.fabric.view.samples, self.emit)
        self.broadcast = broadcast.EnvBroadcast(cfg, self.profile, self.runner, self.job_dir, python, self.job_id,
                                                self.environ, self.emit)

    def emit(self, kind: str, **fields) -> None:
        events.emit(kind, log_dir=str(self.job_dir), job=self.job_id, **fields)

    def _terminated(self) -> bool:
        return self._signal == signal.SIGTERM

    def _on_signal(self, signum: int, _frame) -> None:
        self._signal = signum
        self._wake.set()

    def run(self) -> int:
        """Run the command until it succeeds, gives up or is requeued; `hpcft run`'s exit status. States: start (a
        ConfigError there ends the run before any step, the nodes' memory untouched) → launch → decide → launch
        again, or finish (done, requeue, stop); SIGTERM ends any state. A successor ends the Slurm job last."""
        # Handlers first: SIGUSR1's default action would kill us while we still talk to Slurm.
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGUSR1, signal.SIGTERM)}
        code = EXIT_ERROR
        try:
            saved, info, layout = self._start()
            code = self._loop(saved, info, layout, self._took_over(layout))
            return code
        except HpcftError as exc:  # every run's decisions are recorded, the one that gives up included
            self.emit("decision", level=logging.ERROR, action=Action.STOP.value, cause="error", reason=str(exc),
                      result=EXIT_ERROR)
            self.ledger.summary(Action.STOP, str(exc), self.ledger.load(), EXIT_ERROR, self.stragglers.summary())
            if self._launched:  # the job ends here: nothing of it stays in node memory
                try:
                    self._clean_up(slurmstate.job_info(self.runner, self.job_id).nodes)
                except HpcftError as again:
                    _log.warning("could not clean the job's stores up: %s", again)
            raise
        finally:
            self.agents.close()
            self.standbys.stop()
            self.fabric.close()
            for s, handler in previous.items():
                signal.signal(s, handler)
            if self.generation and not self._job_goes_on:
                self._end_job(code)  # last: Slurm ends this process with the job

    def _start(self) -> tuple[RunState, slurmstate.JobInfo, Layout]:
        """The start state: the saved state, the allocation, the options for its shape, the slots, the services."""
        self._started = time.time()
        saved = self.ledger.load()
        info = slurmstate.job_info(self.runner, self.job_id)
        saved.requeues = max(saved.requeues, info.restarts)
        self._slurm_run = info.restarts
        self._end_time = info.end_time  # a successor's walltime warning (_walltime_near)
        # A node excluded earlier that Slurm allocates again is back in service by Slurm's judgement, and may be the
        # only way the job starts (a reservation of its size); its memory is empty: the agents rebuild it as a spare.
        returned = given_back(saved.excluded, info.nodes, successor=bool(self.generation))
        saved.excluded = [n for n in saved.excluded if n not in returned]
        # a successor plans the layout its predecessor ran, lost node included (Slurm may have removed it from the
        # job): its first decision replaces that node as any lost node is (_took_over); a lost spare is just left out
        lost_slot = self.replaces in saved.slots
        if self.replaces and not lost_slot and self.replaces not in saved.excluded:
            saved.excluded.append(self.replaces)
        nodes = [*info.nodes, *([self.replaces] if lost_slot and self.replaces not in info.nodes else [])]
        usable = sum(n not in saved.excluded for n in nodes)
        if self.generation and saved.slots:  # the job lost nodes before: the slots as they were, the spares left
            self.cfg = self.cfg.but(nodes=len(saved.slots),
                                    spares=max(0, min(self.cfg.launch.spares, usable - len(saved.slots))))
        # the allocation's shape decides what the options mean (auto protection, set sizes): refused before any step
        self.cfg = self.base_cfg = check_shape(self.cfg, usable)
        layout = Layout.plan(nodes, active=self.cfg.launch.nodes, spares=self.cfg.launch.spares,
                             tasks_per_node=self.cfg.launch.tasks_per_node or self.profile.tasks_per_node,
                             excluded=saved.excluded, previous=saved.slots)
        self._launched = True  # from here on the run may have changed the nodes' memory
        # the janitors after this node watch it over the network, and one takes over if it is lost (or requeues)
        self.beacon = succession.start(self.job_dir, self.environ, agent_iface(self.cfg), self.argv,
                                       self.cfg.recovery.takeover, self.cfg.recovery.probe_timeout)
        if returned:
            self.emit("node_returned", level=logging.WARNING, nodes=",".join(returned),
                      reason="excluded by an earlier run, allocated again by Slurm: used as a healthy node whose "
                             "memory is empty")
        kept = [n for i, n in enumerate(layout.slots) if saved.slots[i:i + 1] == [n]]
        self.base_world = layout.world_size
        self.grow_watch.target = len(layout.slots)
        self._requeued_run = saved.requeues > 0
        self.ledger.previous_run(layout, saved.requeues, self.generation)  # before `start`: it reads the events
        self.emit("start", slots=",".join(layout.slots), spares=",".join(layout.spares),
                  excluded=",".join(layout.excluded), restarts=saved.restarts, requeues=saved.requeues,
                  kept=",".join(kept), profile=self.profile.name, protect=self.cfg.protection.protect,
                  group=self.cfg.protection.group, job_dir=str(self.job_dir))
        self.preflight = Preflight(self.cfg, self.profile, self.environ, self.emit, self.job_id)
        self._site_env = self.preflight.start(len(layout.slots))  # RCCL's plugin; the memory plan
        saved.slots = list(layout.slots)  # now: a run that dies with its batch host has said where its data is
        self.ledger.save(saved)
        self.fabric.start(agent_iface(self.cfg))
        if self.cfg.with_agents:
            self.agents.prepare()
        return saved, info, layout

    def _loop(self, saved: RunState, info: slurmstate.JobInfo, layout: Layout, event: Event | None = None) -> int:
        """Launch, decide, launch again or finish; `event`: one to decide on first (a successor's lost node)."""
        while True:
            if self._superseded():
                return EXIT_ERROR
            if event is None:
                self.stragglers.launched(self.cfg, saved.restarts)
                event = self._launch(layout, saved.launches)
                if self._signal == signal.SIGTERM:
                    self.agents.stop()
                    self.emit("terminated", level=logging.WARNING, reason="SIGTERM (scancel, preemption or requeue)")
                    # Slurm is ending or requeuing the job: a successor must not complete it as its batch script
                    # would (a batch script killed so completes nothing either)
                    self._job_goes_on = True
                    return 128 + signal.SIGTERM
            decision, event = self._decide(event, layout, saved, info), None
            relaunch = decision.action in RELAUNCHES
            # the nodes that hold the slots' snapshots: the next launch's (its agents rebuild there; a successor plans
            # from them), else this run's (a requeued run keeps each returning node in its slot)
            saved.slots = list((decision.layout if relaunch else layout).slots)
            layout = decision.layout
            saved.excluded = list(layout.excluded)
            if relaunch:
                saved.count(decision.action)
                self.ledger.save(saved)
                continue
            self.ledger.save(saved)
            if decision.action is not Action.REQUEUE:  # the job is over: nothing of it stays in node memory
                self._clean_up([*layout.slots, *layout.spares, *self.stragglers.evicted])
            return self._finish(decision, saved)

    def _decide(self, event: Event, layout: Layout, saved: RunState, info: slurmstate.JobInfo) -> Decision:
        """The decide state: the policy's decision on `event`, recorded and carried out up to the next launch."""
        state = State(layout=layout, restarts=saved.restarts, max_restarts=self.cfg.recovery.max_restarts,
                      requeue_allowed=self.cfg.recovery.requeue and info.batch and info.requeue,
                      end_time=slurmstate.job_info(self.runner, self.job_id).end_time,
                      requeue_margin=self.cfg.recovery.requeue_margin,
                      min_nodes=(self.cfg.elastic.min_nodes or 1) if self.cfg.elastic.elastic else None)
        decision = decide(event, state, time.time())
        record(decision, event, state, str(self.job_dir))
        self.grow_watch.lost(event.bad_nodes)  # every loss counts against taking a node back (--grow-max-losses)
        if decision.action is Action.REQUEUE:
            self.agents.persist(event.lost_nodes)  # protect + flush, with a closed node's agent too: it still runs
        # a relaunch does not wait for a flush under way (its node-local copies stay for the next one); a shrink
        # lost a node, whose agent no flush can wait for; a grow flushes with them first (Reshaper.grow)
        if decision.action is not Action.GROW and not self._keep_agents(decision, event, layout):
            self.agents.stop(ask=not event.lost_nodes or event.kind is Kind.STRAGGLER,  # an evicted straggler's
                             flush=decision.action not in RELAUNCHES)  # agent is healthy: asked like the others
        self.preflight.poll(self.agents.reports, now=True, expected=self.agents.nodes(layout))  # their final reports
        self.stragglers.carried_out(decision, event)
        if decision.action in (Action.SHRINK, Action.GROW):
            decision = self._reshape(decision, event, state, saved.launches)
        self.ledger.decided(decision, event, self.cfg.protection.protect)
        return decision

    def _keep_agents(self, decision: Decision, event: Event, layout: Layout) -> bool:
        """Whether the agents run on through a relaunch (event `agents_kept`): onto the same slots, after a failure
        that was not theirs nor a node's, with every agent well. They protect what the new trainers snapshot, and the
        relaunch neither waits for their stop nor shares the nodes' cores with their start."""
        if decision.action is not Action.RELAUNCH or decision.layout.slots != layout.slots or event.lost_nodes \
                or event.kind is Kind.AGENT_FAILED or not self.agents.well(layout):
            return False
        self.emit("agents_kept", tag=self.agents.tag, cause=event.kind.value,
                  reason="a relaunch onto the same slots: the running agents protect what the new trainers snapshot")
        return True

    def _took_over(self, layout: Layout) -> Event | None:
        """A successor's start: the steps its predecessor left stopped (but the janitors, of which this process is one,
        and the warm standbys, adopted), and the event to decide on first: the predecessor's node lost. None for the
        batch script's run."""
        if not self.generation:
            return None
        left, kept = stop_steps_left(self.runner, self.job_id, keep=(JANITOR_STEP_NAME, STANDBY_STEP_NAME))
        # the warm standbys on the live nodes are adopted: a new step would import for seconds
        self.standbys.adopt([step for step, name in kept if name == STANDBY_STEP_NAME])
        me = self.environ.get("SLURMD_NODENAME", "?")
        self.emit("takeover", level=logging.WARNING, generation=self.generation, node=me, lost=self.replaces,
                  stopped=",".join(left), reason=f"the supervisor on {self.replaces} was lost with its node: {me} "
                                                 f"supervises the job from here (generation {self.generation})")
        self.ledger.supervisors += [self.replaces, me]
        return Event.nodes_lost({self.replaces: "the supervisor's node: lost"}) if self.replaces in layout.slots \
            else None

    def _walltime_near(self) -> bool:
        """A successor's walltime warning: Slurm signals the batch script, which died with its node."""
        if not self.generation or self._end_time is None:
            return False
        return time.time() >= self._end_time - max(self.cfg.recovery.requeue_margin, self.cfg.launch.poll_interval)

    def _superseded(self) -> bool:
        """Whether a successor took the supervision over (a janitor found this one silent on a node Slurm called
        lost: a network partition, not a crash): then this one touches nothing more, and ends."""
        record = succession.read(self.job_dir)
        if record is None or record.generation <= self.generation:
            return False
        self.agents.stop(ask=False)
        self._job_goes_on = True  # its successor ends it
        self.emit("superseded", level=logging.ERROR, generation=self.generation, successor=record.host,
                  reason=f"the janitors found this supervisor silent and its node lost: {record.host} supervises the "
                         f"job since (generation {record.generation}); this one stops without touching anything")
        return True

    def _end_job(self, code: int) -> None:
        """A successor's last act: end the Slurm job as its batch script would have (that script died with its node),
        COMPLETED for status 0, FAILED otherwise."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # Slurm ends this process with the job: say how first
        how = slurmstate.complete(self.runner, self.job_id, code)
        self.emit("job_ended", level=logging.INFO if code == 0 else logging.WARNING, exit_code=code, by=how,
                  generation=self.generation)

    def _finish(self, decision: Decision, saved: RunState) -> int:
        if decision.action is Action.REQUEUE:
            self._job_goes_on = True
            saved.requeues += 1
            self.ledger.save(saved)
        code = losses.exit_status(int(decision.exit_code or 0), self.ledger.lost, self.cfg.recovery.lost_progress_exit)
        self.ledger.summary(decision.action, decision.reason, saved, code, self.stragglers.summary())
        if decision.action is Action.REQUEUE:
            # in this order: what the next run needs is on disk before the requeue's SIGTERM reaches this process
            self.emit("requeue", level=logging.WARNING, excluded=",".join(saved.excluded), reason=decision.reason)
            try:
                requeue_flag(self.job_dir, self._slurm_run).touch()  # the janitors keep the stores for the next run
            except OSError as exc:
                self.emit("requeue_flag_unwritten", level=logging.ERROR, error=str(exc),
                          consequence="the janitors remove the stores at the requeue: the next run resumes from the "
                                      "durable tier, not from memory")
            done = slurmstate.requeue(self.runner, self.job_id, saved.excluded,
                                      int(self.environ.get("SLURM_JOB_NUM_NODES") or 0))
            saved.slurm_excluded = done.excluded
            self.ledger.save(saved)
            self.emit("requeued", level=logging.WARNING if done.allowed or done.unexcluded else logging.INFO,
                      slurm_excluded=",".join(done.excluded), allowed=",".join(done.allowed), reason=done.reason())
        return code

    def _clean_up(self, nodes: list[str]) -> None:
        """Remove the job's stores from every node's memory (hpcft/launch/node/janitor.py): no site epilog needed."""
        started = time.monotonic()
        code = self.janitor.finish(nodes, self.environ)
        self.emit("cleaned", level=logging.INFO if code == 0 else logging.WARNING, nodes=",".join(nodes),
                  exit_code=code, by=self.janitor.cleaned_by, seconds=round(time.monotonic() - started, 3))

    def _reshape(self, decision: Decision, event: Event, state: State, launches: int) -> Decision:
        """Carry a shrink or grow out (hpcft/launch/reshape.py): the decision, or what replaced it if it failed."""
        done, line = self.reshaper.carry_out(decision, event, state, self._env(state.layout, launches),
                                             f"{launches}-shrink", str(self.job_dir))
        self.ledger.reshaped["grown" if decision.action is Action.GROW else "shrunk"] += [line] if line else []
        if done.action is decision.action:  # the new shape's protection sets, from the run's starting configuration
            self.cfg = elastic.shrunk_config(self.base_cfg, len(done.layout.slots))
        self.grow_watch.reshaped()  # the clock of --grow-every (a failed grow's relaunch counts too)
        return done

    def _launch(self, layout: Layout, launch: int) -> Event:
        """The launch state: the steps beside the trainers (the environment's broadcast, janitors, standbys, and the
        agents when the trainers need them first: `_ready`), then the trainers' step (the agents' once the trainers
        restored when not: AgentSteps.gate, `_watch`), watched until it ends or must be stopped. The agents' step is
        left running for the decision: a requeue first waits for their protection; every other path stops them."""
        env = self._env(layout, launch)
        first = self.cfg.with_agents and self.agents.gate(layout, launch)  # else they start beside the trainers
        # a relaunch whose agents rebuild: the trainers' step starts with theirs, the rebuilt nodes' tasks wait for
        # them (node/gate.py), the others start meanwhile; a first launch's agents pin before any store opens
        gated = self.agents.rebuilt_nodes(layout) if first and launch > 0 else []
        opened = self.job_dir / f"agents-ready-{launch}"
        try:
            event = self._ready(layout, launch, env, agents=first, begin_only=bool(gated))
            if event is not None:
                return event
            argv = trainer_argv(layout, self.profile, self.command, python=self.python,
                                extra=self.cfg.launch.srun_args)
            watch = losses.RestoreWatch(self.job_dir, layout.world_size, since=time.time(), reason="",
                                        before=self.ledger.reached)  # as the last launch ended, not now
            self.emit("launch", restart=launch, slots=",".join(layout.slots), world=layout.world_size,
                      master=f"{layout.master}:{env['MASTER_PORT']}", **({"gated": compress(gated)} if gated else {}))
            self.agent_loss.launched()
            opened.unlink(missing_ok=True)
            proc = self.runner.popen(argv, stderr=subprocess.PIPE, text=True, env={**env, **(gate.env(
                opened, gated, 2 * self.cfg.protection.protect_timeout + 60) if gated else {})})
            lines: list[str] = []
            reader = threading.Thread(target=self._read_trainers, args=(proc, lines), daemon=True)
            reader.start()
            event = None
            try:
                if gated:  # the rebuilt nodes' tasks go on once the file exists
                    event = self._agents_ready(layout, launch, env, opened)
                unready = event is not None
                watch.reason = self.ledger.why_launch + (f"; the agents could not rebuild: {self.agents.no_checkpoint}"
                                                         if self.agents.no_checkpoint else "")
                launched = time.time()  # the hang and start timeouts count from here, the rebuild done
                # none kept through the decision (_keep_agents): new ones once the trainers restored; kept ones that
                # fail later are the watch's (AgentLoss.while_training), never a second set beside them on the stores
                later = (lambda: self.agents.beside(layout, launch, env)) \
                    if self.cfg.with_agents and not first and self.agents.proc is None else None
                if event is None:
                    event = self._watch(proc, layout, launched, watch, functools.partial(
                        self.agent_loss.while_training, layout, restart_count=launch, env=env), lines, later)
            finally:
                self.agents.stop_with_trainers({TRAIN_STEP_NAME: proc}, event, settled=lambda: all(  # srun said so
                    slurmstate.ended_tasks(lines).get(node, 0) >= layout.tasks_per_node
                    for node in layout.slots if node not in event.bad_nodes))  # with the agents' after a loss
                reader.join(timeout=5)
                opened.unlink(missing_ok=True)
            if unready:  # as `_ready` stops agents that never got ready
                self.agents.stop(ask=not event.lost_nodes)
            watch.say(self.emit, self.ledger.lost)
            self.fabric.poll(layout.world_size)  # the step the trainers reached as they ended, in the history
            self.ledger.reached = watch.reached_after(self.fabric.view.reached(layout.world_size))
            if self.ledger.previous is not None and self.ledger.previous.resumed is None:
                self.ledger.previous.resumed = watch.resumed  # what the lost batch host cost, once restored
        except BaseException:
            self.agents.stop()
            raise
        return event if unready else self._ended(event, proc.returncode, lines)  # unready: hpcft stopped them

    def _read_trainers(self, proc: subprocess.Popen, lines: list[str]) -> None:
        """srun's stderr into `lines` until the trainers' step ends, then the watch woken at once: a rank's death is
        decided on when srun exits, not at the next poll (up to --poll-interval later)."""
        tee(proc.stderr, lines)
        proc.wait()
        self._wake.set()

    def _ready(self, layout: Layout, launch: int, env: dict[str, str], agents: bool,
               begin_only: bool = False) -> Event | None:
        """The steps the trainers need first (the agents too when `agents`: launched, and waited for unless
        `begin_only`); an event when the agents could not get ready."""
        self.broadcast.ensure([*layout.slots, *layout.spares], env, (self, self.standbys, self.agents))
        self.janitor.ensure([*layout.slots, *layout.spares], env)
        self.standbys.ensure([*layout.slots, *layout.spares], env, spares=layout.spares)
        if agents:
            self.agents.begin(layout, launch, env)
        if agents and not begin_only:
            event = self._agents_ready(layout, launch, env)
            if event is not None:
                self.agents.stop(ask=not event.lost_nodes)  # a lost node's mesh is broken: no grace to wait
                return event
        self.standbys.wait(layout.slots, interrupted=self._terminated)
        return None

    def _agents_ready(self, layout: Layout, launch: int, env: dict[str, str],
                      opened: Path | None = None) -> Event | None:
        """Wait for the agents `begin` launched; None once ready (`opened` then created: the gated tasks go on), else
        the event their failure is (AgentLoss.before_training)."""
        failure = self.agents.ready(layout, launch, env)
        event = None if failure is None else self.agent_loss.before_training(layout, failure, launch, env)
        if event is None and opened is not None:
            opened.touch()
        return event

    @staticmethod
    def _ended(event: Event, exit_code: int | None, lines: list[str]) -> Event:
        """The watch's event with the trainers' step's exit and srun's per-task errors (none when hpcft stopped it)."""
        stopped = event.kind in (Kind.NODES_RETURNED, Kind.STRAGGLER)  # the tasks' errors are hpcft's own stop
        failed = () if stopped else tuple(slurmstate.task_errors(lines))
        refused = slurmstate.step_refusal(lines) if event.kind is Kind.TASK_FAILED else None
        if refused:
            return Event(Kind.STEP_REFUSED, exit_code=exit_code, failed_tasks=failed, detail=refused)
        return dataclasses.replace(event, exit_code=exit_code, failed_tasks=failed)

    def _env(self, layout: Layout, launch: int) -> dict[str, str]:
        """The steps' environment for one launch on `layout` (the agents' and the trainers')."""
        user = self.environ.get("USER") or getpass.getuser()
        env = step_env(layout, job_id=self.job_id, restart_count=launch, job_dir=str(self.job_dir),
                       profile_env=profiles.env_defaults(self.profile, self.environ, user=user, job=self.job_id,
                                                         plugin=self._site_env))
        env = {**self.environ, **env, **elastic.trainer_env(self.cfg, self.base_world),
               **copy_env(self.cfg), **self.standbys.env(), **self.fabric.env(self.cfg.with_agents)}
        durable = durable_dir(self.cfg, self.job_dir)
        if durable is not None:
            env[ENV_PERSIST] = str(durable)  # where the trainers' restore finds the durable tier
            if self.cfg.durable.persist_local:
                env[ENV_LOCAL] = self.cfg.durable.persist_local  # and its first level
        return env

    def _watch(self, proc: subprocess.Popen, layout: Layout, launched: float, watch: losses.RestoreWatch,
               agents_lost: Callable[[dict[str, str]], Event | None], said: list[str],
               later: Callable[[], None] | None = None) -> Event:
        """Until the trainers' step ends or must be stopped; `agents_lost` (AgentLoss.while_training) answers agents
        that failed meanwhile: an event, or None when the agents were restarted alone and the trainers go on. Slurm
        is asked about the slots' nodes as watch/slurm.py says, from srun's lines `said` and the nodes' reports.
        `later()` starts the agents of a relaunch that needs nothing of them once every rank has restored (or
        BESIDE_AFTER_S after the launch): their start takes nothing from the trainers' until then."""
        slurm = SlurmWatch(self.nodes, self.fabric.view, layout, self.cfg.recovery.slurm_check_every, launched, said)
        while True:
            watch.say(self.emit, self.ledger.lost)
            if later is not None and (watch.resumed is not None or time.time() - launched > BESIDE_AFTER_S):
                later()
                later = None
            self.fabric.poll(layout.world_size)  # the progress history: a point when every rank's step moved
            self.preflight.poll(self.agents.reports, expected=self.agents.nodes(layout))  # the plan, once all snapshot
            self.agents.forward_requests()  # `hpcft flush` by hand
            code = proc.poll()
            if code is not None:
                if code == 0:
                    return Event(Kind.SUCCESS, exit_code=0)
                bad = self.nodes.bad(layout.slots, probe=True)
                if bad:
                    return Event.nodes_lost(bad, exit_code=code, closed=self.nodes.closed_now)
                return Event(Kind.TASK_FAILED, exit_code=code)
            if self._signal is not None:
                if self._signal != signal.SIGUSR1:
                    return Event(Kind.WALLTIME, detail=f"signal {self._signal}")
                stale = self._stale_signal()
                if stale is None:
                    self.emit("signal", level=logging.WARNING, signal="USR1", meaning="walltime warning")
                    return Event(Kind.WALLTIME, detail=f"signal {self._signal}")
                self.emit("signal", level=logging.WARNING, signal="USR1", meaning="stale", ignored=True, reason=stale)
                self._signal = None
            if self._walltime_near():
                return Event(Kind.WALLTIME, detail="the walltime is near (a successor gets no USR1: it watches the "
                                                   "job's end time itself)")
            bad = slurm.poll()  # a drain alone stops nothing
            if bad:
                return Event.nodes_lost(bad)
            self.agent_loss.ahead(layout)  # late peers: probed now, the verdict in by their loss timeout
            suspects = self.agents.lost(layout)
            if suspects is not None and (event := agents_lost(suspects)) is not None:
                return event
            slow = self.stragglers.poll(layout, self.agents.protected)  # --evict-stragglers: one due for eviction
            if slow is not None:
                return slow
            returned = self.grow_watch.poll(layout)  # --elastic-grow, on a shrunk job
            if returned is not None:
                return returned
            why = self.fabric.hung(launched, self.cfg.recovery.hang_timeout, self.cfg.recovery.start_timeout)
            if why:
                return Event(Kind.HANG, detail=why)
            if self._wake.wait(self.cfg.launch.poll_interval):  # a signal, the trainers' srun ended, an agent failed
                self._wake.clear()  # each is looked at again above, after the clear: none is missed

    def _stale_signal(self) -> str | None:
        """Why the USR1 just received is not for this run (policy.stale_signal over fresh Slurm data), or None."""
        try:
            end = slurmstate.job_info(self.runner, self.job_id).end_time
        except SlurmError as exc:
            _log.warning("cannot read the job's end time, taking USR1 as a walltime warning: %s", exc)
            return None
        now = time.time()
        return stale_signal(requeued_run=self._requeued_run,
                            progressed=self.fabric.view.last_change(self._started) > self._started,
                            time_left=None if end is None else end - now, margin=self.cfg.recovery.requeue_margin)
