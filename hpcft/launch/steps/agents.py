"""The node agents' srun step of each launch of `hpcft run --protect`: launched before the trainers and waited on until
all are ready when the trainers need them first (the first launch, or slots changed since agents were last ready: they
rebuild), else beside the trainers; drained before a requeue (the trainers gone, the newest step is protected without
caps), stopped. The supervisor turns a failure here into a policy event."""
from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from hpcft.agent.transport import mpiworld, rendezvous, secret as job_secret
from hpcft.agent import status as agent_status
from hpcft.agent.step import AGENT_STEP_NAME, agent_argv
from hpcft.errors import CheckpointError, NoCheckpointError
from hpcft.agent.protection import flush as agent_persist
from hpcft.launch.config.model import RunConfig
from hpcft.launch.policy.layout import Layout
from hpcft.launch.fabric.liveview import LiveView
from hpcft.launch.policy.failures import Event, Kind
from hpcft.launch.steps.agentconf import agent_iface, agent_mpi, agent_settings
from hpcft.launch.steps.persist import Persisting
from hpcft.launch.steps.standbys import cpus_per_node
from hpcft.launch.steps.stop import SETTLE_POLL_S
from hpcft.slurm.runner import Runner


class StepEnded(CheckpointError):
    """The agents' step ended early; `exit_status` negative: srun died of that signal, its tasks may outlive it."""

    def __init__(self, message: str, exit_status: int | None):
        super().__init__(message)
        self.exit_status = exit_status


PROBE_EVERY_S = 5.0  # while the agents get ready: Slurm asked about the slots' nodes and a probe of them this often


class AgentSteps(Persisting):
    """One job's agents' steps. `stop_steps` stops {step name: srun} (SIGTERM, then kill); `check_nodes(layout, probe,
    until)` returns the bad nodes among the slots (scontrol, and the probe when `probe`, cut short once `until()`);
    `view` holds the agents' reports (without it, their status files are read)."""

    def __init__(self, config: Callable[[], RunConfig], runner: Runner, job_dir: Path, python: str, *,
                 emit: Callable[..., None],
                 stop_steps: Callable[[Mapping[str, subprocess.Popen]], None], interrupted: Callable[[], bool],
                 check_nodes: Callable[[Layout, bool, Callable[[], bool]], dict[str, str]],
                 view: LiveView | None = None, order: Callable[..., None] | None = None):
        self._config, self.runner, self.job_dir, self.python = config, runner, job_dir, python
        self._order = order  # Fabric.order: a request pushed to the agents over their uplinks
        self.view = view  # the agents' statuses as they report them over the network (launch/fabric.py)
        self.emit, self._stop_steps, self._interrupted, self._check_nodes = emit, stop_steps, interrupted, check_nodes
        self.bad_nodes: dict[str, str] = {}  # found while the last launch's agents got ready
        self.rendezvous = job_dir / "agents"  # the agents' addresses and status files (shared filesystem)
        self.proc: subprocess.Popen | None = None  # the running step, kept until the supervisor's decision
        self.hosted_procs: dict[str, subprocess.Popen] = {}  # a shrink's agents standing in for lost slots
        self.tag = ""
        self._ready_slots: tuple[str, ...] | None = None  # slots whose agents were last ready
        self._rebuild, self._hosted = False, dict[int, str]()  # what `begin` launched, for `ready`
        self.no_checkpoint: str | None = None  # why the last launch's agents could rebuild nothing, if so
        self.directory: rendezvous.Directory | None = None  # where every launch's agents meet (over the network)
        self._killed = False  # the running step was killed with the trainers' (a lost node), not yet reported
        self._forwarded: str | None = None  # the last flush request file (`hpcft flush`) pushed to the agents
        self._ending: list[subprocess.Popen] = []  # stopped launches' sruns, their agents exiting (`stop`)
        self._beside: float | None = None  # agents started beside the trainers: ready by then (time.monotonic())

    @property
    def cfg(self) -> RunConfig:
        """The run's options now (the supervisor's own: a shrink or grow changes the protection sets)."""
        return self._config()

    def _ask(self, **asked: str | bool) -> None:
        """Ask the agents of the last launch (drain, stop, flush=<id>): over their uplinks, and in the request files
        that agents started by hand (no uplink) read."""
        if "drain" in asked:
            agent_status.request_drain(self.rendezvous, self.tag)
        if "stop" in asked:
            agent_status.request_stop(self.rendezvous, self.tag)
        if self._order is not None:
            self._order(self.tag, **asked)

    def forward_requests(self) -> None:
        """`hpcft flush`, typed by hand, writes a request file: the supervisor alone reads it (per poll) and pushes
        it to the agents, so that no node polls the shared file system for it."""
        if self._order is None or not self.tag or self.proc is None:
            return
        rid = agent_persist.read_request(self.rendezvous, self.tag)
        if rid is not None and rid != self._forwarded:
            self._forwarded = rid
            self._order(self.tag, flush=rid)

    def _read(self, tag: str) -> dict[int, dict]:
        """{slot: status} of the agents of launch `tag`."""
        return self.view.reports(tag) if self.view is not None else agent_status.read(self.rendezvous, tag)

    def prepare(self) -> None:
        """The rendezvous directory (status files), the per-job secret (0600; kept across relaunches and requeues)
        and the agents' directory service on this host, given as this host's addresses (its --agent-iface one when it
        has one; rendezvous.addresses), event `agents_directory`."""
        if agent_mpi(self.cfg):  # before anything is launched: ConfigError naming what to install
            self.emit("agents_transport", transport="mpi", mpi=agent_mpi(self.cfg), library=mpiworld.library(),
                      heartbeats="tcp", on_loss="every agent loss ends the agents' whole step; its relaunch is a "
                      "fresh MPI world (no agent ever rejoins a running one)")
        self.rendezvous.mkdir(exist_ok=True)
        secret = job_secret.load(str(job_secret.create(self.job_dir)))
        if self.directory is None:
            hosts = rendezvous.addresses(agent_iface(self.cfg))
            self.directory = rendezvous.Directory(secret, host=",".join(hosts))
            self.emit("agents_directory", address=self.directory.address)

    def close(self) -> None:
        """The supervisor ends: stop serving the agents' directory, and wait for the stopped launches' sruns (killed
        past the grace: their agents had said they stopped)."""
        for p in self._ending:
            try:
                p.wait(timeout=self.cfg.launch.kill_grace)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._ending = []
        if self.directory is not None:
            self.directory.close()
            self.directory = None

    def gate(self, layout: Layout, restart_count: int) -> bool:
        """Whether the trainers of a launch wait for its agents (`start`): on the first launch (its agents announce
        their pins before any store opens) and when they rebuild first (`_moved`). A relaunch onto the same slots
        needs nothing of them: they start beside the trainers (`beside`)."""
        return restart_count == 0 or self._moved(layout, restart_count)

    def _moved(self, layout: Layout, restart_count: int) -> bool:
        """A relaunch onto other slots than those agents were last ready on: its agents rebuild what moved."""
        return restart_count > 0 and layout.slots != self._ready_slots

    def well(self, layout: Layout) -> bool:
        """Whether the last launch's agents run on `layout`'s slots, none failed nor unready (`lost`): a relaunch onto
        the same slots keeps them (the supervisor's `_keep_agents`)."""
        return self.proc is not None and not self.hosted_procs and self._ready_slots == layout.slots \
            and self.lost(layout) is None

    def beside(self, layout: Layout, restart_count: int, env: Mapping[str, str]) -> None:
        """Launch the agents beside the trainers (not `gate`d): no rebuild, their readiness checked while the trainers
        run (`lost`), a second or so of their start off the relaunch's path."""
        self.tag, self.no_checkpoint, self.bad_nodes = str(restart_count), None, {}
        self.proc = self._launch(layout, False, env)
        self._beside = time.monotonic() + self.cfg.protection.protect_timeout

    def start(self, layout: Layout, restart_count: int, env: Mapping[str, str], *,
              hosted: Mapping[int, str] | None = None, tag: str | None = None) -> CheckpointError | None:
        """Launch the agents (rebuilding when the slots changed since they were last ready) and wait for all; None, or
        why not (the step left for `stop`). Nothing to rebuild (NoCheckpointError) is no failure: fresh agents protect
        what the trainers restore. `hosted` {slot: survivor}: a shrink's lost slots, rebuilt from parity there."""
        self.begin(layout, restart_count, env, hosted=hosted, tag=tag)
        return self.ready(layout, restart_count, env)

    def rebuilt_nodes(self, layout: Layout) -> list[str]:
        """The nodes of `layout` whose slot the agents rebuild at its launch: not where they were last ready."""
        return [n for i, n in enumerate(layout.slots) if (self._ready_slots or ())[i:i + 1] != (n,)]

    def begin(self, layout: Layout, restart_count: int, env: Mapping[str, str], *,
              hosted: Mapping[int, str] | None = None, tag: str | None = None) -> None:
        """`start`'s launch alone: `ready` waits for them (the trainers may start in between, node/gate.py)."""
        hosted = dict(hosted or {})
        self._rebuild, self._hosted = bool(hosted) or self._moved(layout, restart_count), hosted
        self.tag, self.no_checkpoint, self.bad_nodes, self._beside = tag or str(restart_count), None, {}, None
        self.proc = self._launch(layout, self._rebuild, env, hosted)

    def ready(self, layout: Layout, restart_count: int, env: Mapping[str, str]) -> CheckpointError | None:
        """`start`'s wait for the agents `begin` launched: None once all are ready, else why not."""
        rebuild, hosted = self._rebuild, self._hosted
        running = Layout(slots=tuple(n for i, n in enumerate(layout.slots) if i not in hosted))
        try:
            try:
                ready = self._wait(len(layout.slots), running)
            except NoCheckpointError as exc:
                if hosted:
                    raise
                self.no_checkpoint = str(exc)
                self.emit("agents_no_checkpoint", level=logging.WARNING, tag=self.tag, reason=str(exc),
                          action="trainers start from what they can restore; agents relaunched without rebuild")
                self._stop_steps({AGENT_STEP_NAME: self.proc})
                self.tag, rebuild = f"{restart_count}-fresh", False
                self.proc = self._launch(layout, rebuild, env)
                ready = self._wait(len(layout.slots), running)
        except CheckpointError as exc:
            self.emit("agents_failed", level=logging.WARNING, tag=self.tag, reason=str(exc))
            return exc
        self._ready_slots = layout.slots
        self.emit("agents_ready", tag=self.tag, rebuild=rebuild, step=ready.step,
                  rebuilt=",".join(hosted.get(i, layout.slots[i]) for i in ready.rebuilt))
        return None

    def _launch(self, layout: Layout, rebuild: bool, env: Mapping[str, str],
                hosted: Mapping[int, str] | None = None) -> subprocess.Popen:
        """`srun … python -m hpcft.agent` on the active slots (hpcft.agent.step), output to the job dir; with
        `hosted`, on the slots' nodes but those, and one step more per hosted slot on its survivor."""
        hosted = hosted or {}
        tag, cfg = self.tag, self.cfg
        if self.directory is not None:  # a rerun of the tag must not meet old agents' addresses (as the files below)
            self.directory.forget(tag)
            env = {**env, rendezvous.ENV: self.directory.address}
        if self.view is not None:  # nor their reports
            self.view.forget(tag)
        for stale in self.rendezvous.glob(f"agent-{tag}-*"):  # a rerun with the same job dir must not meet old ones
            stale.unlink(missing_ok=True)
        mpi = agent_mpi(cfg)
        if mpi and hosted:  # one MPI world is one srun step: the hosted agents' steps could not join it
            mpi = None
            self.emit("agents_transport", level=logging.WARNING, tag=tag, transport="tcp", wanted="mpi",
                      reason="agents standing in for lost slots run as srun steps of their own, which cannot join "
                             "the others' MPI world: this launch's agents mesh over TCP")

        # on the command line, not in a file: a full job directory must not stop a launch
        settings = agent_settings(cfg, self.job_dir, layout, mpi)

        def argv(nodes: list[str]) -> list[str]:
            return agent_argv(nodes, settings, python=self.python, rebuild=rebuild, mpi=mpi, wrap=self._wrap(),
                              cpus=cpus_per_node(env)) + ["--tag", tag]

        self.emit("agents_launch", tag=tag, rebuild=rebuild, slots=",".join(layout.slots),
                  scheme=cfg.protection.protect, group=cfg.protection.group, losses=cfg.protection.losses,
                  distance=cfg.protection.distance, cpu_budget=settings.cpu_cores, lag_bound=settings.lag_bound,
                  cpu_ceiling=settings.lag_cores if settings.lag_bound else settings.cpu_cores,
                  node_cpus=cpus_per_node(env),
                  **({"hosted": ",".join(f"{k}:{n}" for k, n in hosted.items())} if hosted else {}))
        with open(self.job_dir / f"agents-{tag}.log", "ab") as log:
            for k, node in hosted.items():
                name = f"{AGENT_STEP_NAME}-hosted-{k}"
                self.hosted_procs[name] = self.runner.popen(
                    [f"--job-name={name}" if a.startswith("--job-name=") else a for a in argv([node])] +
                    ["--slot", str(k), "--slots", str(len(layout.slots)), "--hosted"],
                    env=dict(env), stdout=log, stderr=subprocess.STDOUT)
            return self.runner.popen(argv([n for i, n in enumerate(layout.slots) if i not in hosted]), env=dict(env),
                                     stdout=log, stderr=subprocess.STDOUT)

    def _wait(self, count: int, layout: Layout) -> agent_status.Ready:
        """agent_status.wait_ready for `count` agents on `layout`, in slices so that their step ending, a node lost
        (the agents would wait for it until their mesh timeout), a SIGTERM or --protect-timeout end the wait with a
        CheckpointError (NoCheckpointError as wait_ready)."""
        tag, proc = self.tag, self.proc
        deadline = time.monotonic() + self.cfg.protection.protect_timeout
        probe_at = time.monotonic() + PROBE_EVERY_S
        while True:
            try:
                return agent_status.wait_ready(self.rendezvous, tag, count, timeout=self.cfg.launch.poll_interval,
                                               reports=self._read)
            except NoCheckpointError:
                raise
            except CheckpointError as exc:
                reports = self._read(tag).values()
                if any(r.get("phase") == agent_status.FAILED for r in reports):
                    raise
                if time.monotonic() > deadline:
                    raise CheckpointError(
                        f"{exc} (--protect-timeout {self.cfg.protection.protect_timeout:g} s)") from None
            if proc is None or proc.poll() is not None:
                raise StepEnded(f"the agents' step ended (exit status {proc and proc.returncode}) before every "
                                f"agent was ready; see {self.job_dir / f'agents-{tag}.log'}", proc and proc.returncode)
            if self._interrupted():
                raise CheckpointError("interrupted by SIGTERM")
            if time.monotonic() < probe_at:  # Slurm is asked with the probe only: not every poll (watch/slurm.py)
                continue
            # an agent that fails meanwhile (its heartbeats named a peer) ends the probe: its suspect is probed next,
            # timed against its peers (AgentLoss.not_ready), as while training
            self.bad_nodes = self._check_nodes(layout, True, lambda: any(
                r.get("phase") == agent_status.FAILED for r in self._read(tag).values()))
            if self.bad_nodes:
                raise CheckpointError("node(s) lost while the agents got ready: " +
                                      "; ".join(f"{n}: {why}" for n, why in self.bad_nodes.items()))
            probe_at = time.monotonic() + PROBE_EVERY_S

    def lost(self, layout: Layout) -> dict[str, str] | None:
        """While the trainers run: None when the running launch's agents are well. Else {node: why} of the nodes to
        check: those whose agent a failed agent lost (its report's `peer_slot`: the round's all-gather is the agents'
        heartbeat), every slot when no report names one (the step ended, or an agent failed on its own), or those
        whose agent, started `beside` the trainers, is not ready within --protect-timeout."""
        if self.proc is None:
            return None
        reports = self._read(self.tag)
        failed = [r for r in reports.values() if r.get("phase") == agent_status.FAILED]
        if not failed and self.proc.poll() is None:
            return self._unready(layout, reports)
        named = {layout.slots[r["peer_slot"]]: f"agent of slot {r.get('slot')} lost it: {r.get('error')}"
                 for r in failed if isinstance(r.get("peer_slot"), int) and 0 <= r["peer_slot"] < len(layout.slots)}
        if named:
            return named
        why = "; ".join(f"agent of slot {r.get('slot')} failed: {r.get('error')}" for r in failed) or \
            f"the agents' step ended (exit status {self.proc.poll()}); see {self.job_dir / f'agents-{self.tag}.log'}"
        return dict.fromkeys(layout.slots, why)

    def late(self, layout: Layout) -> dict[str, str]:
        """{node: why} of the nodes whose agent a running agent has not heard for over half the loss timeout (its
        report's `late_peers`): probed ahead (AgentLoss.ahead), named lost only once the timeout passes (`lost`)."""
        if self.proc is None:
            return {}
        return {layout.slots[p]: f"the agent of slot {r.get('slot')} has not heard its agent for over half the loss "
                                 f"timeout ({self.cfg.recovery.loss_timeout:g} s)"
                for r in self._read(self.tag).values() for p in r.get("late_peers") or ()
                if isinstance(p, int) and 0 <= p < len(layout.slots)}

    def _unready(self, layout: Layout, reports: Mapping[int, dict]) -> dict[str, str] | None:
        """The agents started `beside` the trainers: once all are ready, event `agents_ready` (`beside=True`); past
        --protect-timeout, {node: why} of those that are not; else None."""
        if self._beside is None:
            return None
        ready = {slot for slot, r in reports.items() if r.get("phase") in (agent_status.READY, agent_status.PROTECTING)}
        if ready >= set(range(len(layout.slots))):
            self._beside = None
            self.emit("agents_ready", tag=self.tag, rebuild=False, step=None, rebuilt="", beside=True)
            return None
        if time.monotonic() < self._beside:
            return None
        why = (f"its agent was not ready within --protect-timeout {self.cfg.protection.protect_timeout:g} s; see "
               f"{self.job_dir / f'agents-{self.tag}.log'}")
        return {n: why for i, n in enumerate(layout.slots) if i not in ready}

    def reports(self) -> list[dict]:
        """The last launch's agents' status reports, final once stopped; none without agents."""
        return list(self._read(self.tag).values()) if self.tag else []

    def nodes(self, layout: Layout) -> int | None:
        """How many agents report on `layout` (one per active node), or None when the run has no agents."""
        return len(layout.slots) if self.cfg.with_agents else None

    def _wrap(self) -> list[str]:
        """The agents' task goes through a node's warm standby when the job runs them (hpcft.launch.node.handoff)."""
        return [self.python, "-m", "hpcft.launch.node.handoff", "--"] if self.cfg.standby.standby else []

    def protected(self) -> int | None:
        """The newest step every agent of the last launch reports protected, if each reports one."""
        steps = [r.get("protected") for r in self._read(self.tag).values()]
        return min(steps) if steps and None not in steps else None

    def stop_with_trainers(self, trainers: Mapping[str, subprocess.Popen | None], event: Event | None,
                           settled: Callable[[], bool] | None = None) -> None:
        """Stop the trainers' step after `event`, and when it lost a node the agents' too (their mesh is broken): one
        lost-node grace for both, ended once `settled()` (srun saw every other node's trainers end); `stop` then only
        reports it."""
        lost = bool(event and event.lost_nodes)  # a closed node's agent is well: asked later, like the others
        if not lost or event.kind is Kind.STRAGGLER:
            self._stop_steps(trainers, lost=lost, settled=settled)
            return
        self._killed = self.proc is not None and self.proc.poll() is None
        self._stop_steps({**trainers, **({AGENT_STEP_NAME: self.proc} if self.proc else {}), **self.hosted_procs},
                         lost=True, settled=settled)

    def _said_stopped(self) -> bool:
        """Every agent of the last launch reported `stopped`: what is left of its step is processes exiting."""
        reports = self._read(self.tag)
        return bool(self._ready_slots) and len(reports) >= len(self._ready_slots) and all(
            r.get("phase") == agent_status.STOPPED for r in reports.values())

    def stop(self, ask: bool = True, flush: bool = True) -> None:
        """Stop the agents' step of the last launch, if it runs: asked to (each agent exits 0 within a poll, after a
        flush under way when `flush`), until every agent said it stopped (its srun, ending, is then reaped in the
        background) or for up to --kill-grace, then killed with the step. `ask=False` kills at once (a node was lost:
        the mesh is broken, and recovery must not wait)."""
        if self.proc is None:
            return
        killed, self._killed = self._killed, False  # already, with the trainers (stop_with_trainers)
        how = "killed" if killed else "exited" if self.proc.poll() is not None else "asked" if ask else "killed"
        ending = False  # every agent said it stopped: its srun ends in the background (the step is --overlap)
        if how == "asked":
            if flush:
                self._finish_flush()
            self._ask(stop=True)
            procs, deadline = [self.proc, *self.hosted_procs.values()], time.monotonic() + self.cfg.launch.kill_grace
            while any(p.poll() is None for p in procs):
                if not self.hosted_procs and self._said_stopped():
                    ending = True
                    break
                if time.monotonic() >= deadline:
                    how = "killed"
                    break
                time.sleep(SETTLE_POLL_S)
        asked = how != "exited" and ask and not killed
        if ending:
            self._ending.append(self.proc)
        else:
            self._stop_steps({AGENT_STEP_NAME: self.proc, **self.hosted_procs}, lost=not ask)
        self._ending = [p for p in self._ending if p.poll() is None]
        self.hosted_procs, self._beside = {}, None
        # asked (healthy agents): none runs now, so none is "protecting", whether or not its last report came
        marked = self.view.ended(self.tag, how) if asked and self.view is not None else []
        # ending: every agent said it stopped (each exits 0 then); its srun, still ending, is not waited for
        self.emit("agents_stopped", exit_code=0 if ending else self.proc.returncode, how=how,
                  **({"srun": "ending"} if ending else {}),
                  **({"unreported": ",".join(map(str, marked))} if marked else {}))
        self.proc = None
