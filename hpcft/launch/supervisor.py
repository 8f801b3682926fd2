"""The run loop of `hpcft run` as a state machine (`Supervisor.run`): start, launch (the steps, then the trainers
watched: their exit, the slots' nodes, progress over the network, the agents, SIGUSR1), decide (the policy's decision
carried out), launch again or finish. The launch state is in launch/launching.py; what outlives a requeue is in the
ledger's state.json (launch/ledger.py)."""
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from hpcft import events
from hpcft.errors import ConfigError, HpcftError
from hpcft.launch import reshape as elastic, losses
from hpcft.launch.config import profiles
from hpcft.launch.steps import broadcast
from hpcft.launch.watch.grow import GrowWatch
from hpcft.launch.steps.agentloss import AgentLoss
from hpcft.launch.steps.agentconf import agent_iface
from hpcft.launch.steps.agents import AgentSteps
from hpcft.launch.fabric.service import Fabric
from hpcft.launch.config.model import RunConfig
from hpcft.launch.config.resolve import check_paths, check_shape
from hpcft.launch.node import succession
from hpcft.launch.node.janitor import JANITOR_STEP_NAME, Janitor, requeue, requeue_flag
from hpcft.launch.policy.layout import Layout, given_back, run_shape
from hpcft.launch.launching import LaunchState
from hpcft.launch.ledger import Ledger
from hpcft.launch.policy.state import RunState
from hpcft.launch.policy.failures import EXIT_ERROR, Action, Decision, Event, Kind, State, decide, record
from hpcft.launch.steps.preflight import Preflight
from hpcft.launch.node.nodecheck import NodeCheck
from hpcft.launch.steps.standbys import STANDBY_STEP_NAME, Standbys
from hpcft.launch.steps.stop import StepStopper, stop_steps_left
from hpcft.launch.watch.protection import ProtectionWatch
from hpcft.launch.watch.stragglers import StragglerWatch
from hpcft.slurm import state as slurmstate
from hpcft.slurm.runner import Runner

_log = logging.getLogger(__name__)
RELAUNCHES = (Action.RELAUNCH, Action.REPLACE, Action.SHRINK, Action.GROW, Action.EVICT)  # what launches again


class Supervisor(LaunchState):
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
        self.asked = cfg.launch  # the nodes and spares asked for (a run has the spares its allocation has)
        self.grow_watch = GrowWatch(cfg, self.runner, self.job_id, self.nodes, self.emit)
        self.stragglers = StragglerWatch(cfg, self.fabric.view.samples, self.emit)
        self.protection = ProtectionWatch(self.emit)
        self.broadcast = broadcast.EnvBroadcast(cfg, self.profile, self.runner, self.job_dir, python, self.job_id,
                                                self.environ, self.emit)

    def emit(self, kind: str, **fields) -> None:
        events.emit(kind, log_dir=str(self.job_dir), job=self.job_id, **fields)

    def _watched(self) -> dict[str, str]:
        """What the run's watches add to its summary (evictions, protection stalls)."""
        return {**self.stragglers.summary(), **self.protection.summary()}

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
            self.ledger.summary(Action.STOP, str(exc), self.ledger.load(), EXIT_ERROR, self._watched())
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
        ran = len(saved.slots) if self.generation or saved.requeues else 0
        active, spares = run_shape(ran, self.asked.nodes, self.asked.spares, usable, successor=bool(self.generation))
        # the allocation's shape decides what the options mean (auto protection, set sizes): refused before any step
        self.cfg = self.base_cfg = check_shape(self.cfg.but(nodes=active, spares=spares), usable)
        if spares < self.asked.spares and not self.generation:  # a successor's allocation lost its node: said
            self.emit("spares_short", level=logging.WARNING, spares=spares, asked=self.asked.spares,
                      reason=f"the allocation has {usable} usable node(s) for {active} active node(s): "
                             f"{spares} of the {self.asked.spares} spare(s) asked for (hpcft submit asks Slurm for "
                             "a range, which it fills with the nodes in service)")
        layout = Layout.plan(nodes, active=self.cfg.launch.nodes, spares=self.cfg.launch.spares,
                             tasks_per_node=self.cfg.launch.tasks_per_node or self.profile.tasks_per_node,
                             excluded=saved.excluded, previous=saved.slots)
        self._launched = True  # from here on the run may have changed the nodes' memory
        # the janitors after this node watch it over the network, and one takes over if it is lost (or requeues)
        self.beacon = succession.start(self.job_dir, self.environ, agent_iface(self.cfg), self.argv,
                                       self.cfg.recovery.takeover, self.cfg.recovery.probe_timeout,
                                       self.cfg.recovery.loss_timeout)
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
                self.protection.launched()
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
        self.ledger.summary(decision.action, decision.reason, saved, code, self._watched())
        if decision.action is Action.REQUEUE:
            # in this order: what the next run needs is on disk before the requeue's SIGTERM reaches this process
            self.emit("requeue", level=logging.WARNING, excluded=",".join(saved.excluded), reason=decision.reason)
            try:
                requeue_flag(self.job_dir, self._slurm_run).touch()  # the janitors keep the stores for the next run
            except OSError as exc:
                self.emit("requeue_flag_unwritten", level=logging.ERROR, error=str(exc),
                          consequence="the janitors remove the stores at the requeue: the next run resumes from the "
                                      "durable tier, not from memory")
            done = requeue(self.runner, self.job_id, saved.excluded, self.environ, saved)
            self.ledger.save(saved)
            self.emit("requeued", level=logging.WARNING if done.allowed or done.unexcluded else logging.INFO,
                      **done.said())
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
