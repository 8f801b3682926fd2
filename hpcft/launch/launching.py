"""The launch state of `hpcft run`'s state machine (launch/supervisor.py): the steps beside the trainers, the
trainers' step, and the watch that ends in the event the supervisor decides on. A part of the Supervisor, apart for
its size: its methods use the collaborators `Supervisor.__init__` makes."""
import dataclasses
import functools
import getpass
import logging
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from hpcft.durable.catalog import ENV_PERSIST
from hpcft.durable.local import ENV_LOCAL
from hpcft.errors import SlurmError
from hpcft.launch import losses, reshape as elastic
from hpcft.launch.config import profiles
from hpcft.launch.config.resolve import copy_env, durable_dir
from hpcft.launch.node import gate
from hpcft.launch.node.srun import TRAIN_STEP_NAME, step_env, trainer_argv
from hpcft.launch.policy.failures import Event, Kind, stale_signal
from hpcft.launch.policy.layout import Layout
from hpcft.launch.steps.stop import tee
from hpcft.launch.watch.slurm import SlurmWatch
from hpcft.slurm import state as slurmstate
from hpcft.slurm.nodelist import compress

_log = logging.getLogger(__name__)
BESIDE_AFTER_S = 30.0  # a relaunch's agents start once every rank restored, or this long after the launch at the latest


class LaunchState:
    """The Supervisor's launch state (`_launch`) and its watch (`_watch`)."""

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
            if self.cfg.protection.protected:
                self.protection.poll(self.agents.protected(), self.fabric.view.reached(layout.world_size),
                                     sum(bool(r.get("flushing")) for r in self.agents.reports()))
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
