"""The node agents' srun step of each launch of `hpcft run --protect`: launched before the trainers (with a
rebuild when the slots changed since agents were last ready), waited on until every agent is ready, drained
before a requeue (the trainers are gone: the newest step is protected without caps), stopped.
The supervisor (hpcft/launch/supervisor.py) owns the run loop and turns a failure here into a policy event."""
from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from hpcft.agent import secret as job_secret
from hpcft.agent import status as agent_status
from hpcft.agent.launch import AGENT_STEP_NAME, agent_argv
from hpcft.errors import CheckpointError, NoCheckpointError
from hpcft.launch import profiles
from hpcft.agent import persist as agent_persist
from hpcft.durable.settings import PersistConfig
from hpcft.launch.config import RunConfig, durable_dir, scheme
from hpcft.launch.layout import Layout
from hpcft.slurm.runner import Runner


def agent_iface(cfg: RunConfig) -> str | None:
    """The interface the agents bind to: --agent-iface, else the profile's ('none': the hostname's address)."""
    name = cfg.agent_iface or profiles.get(cfg.profile).agent_iface
    return None if name == "none" else name


PROBE_EVERY_S = 5.0  # while the agents get ready: a probe of the slots' nodes this often (scontrol every poll)


class AgentSteps:
    """One job's agents' steps. `emit` records events, `stop_steps` stops {step name: srun} (the supervisor's
    SIGTERM-then-kill), `interrupted` says whether `hpcft run` got SIGTERM, `check_nodes(layout, probe)` returns
    the bad nodes among the slots (the supervisor's scontrol check, and its probe when `probe`)."""

    def __init__(self, cfg: RunConfig, runner: Runner, job_dir: Path, python: str, *, emit: Callable[..., None],
                 stop_steps: Callable[[Mapping[str, subprocess.Popen]], None], interrupted: Callable[[], bool],
                 check_nodes: Callable[[Layout, bool], dict[str, str]]):
        self.cfg, self.runner, self.job_dir, self.python = cfg, runner, job_dir, python
        self.emit, self._stop_steps, self._interrupted, self._check_nodes = emit, stop_steps, interrupted, check_nodes
        self.bad_nodes: dict[str, str] = {}  # found while the last launch's agents got ready
        self.rendezvous = job_dir / "agents"  # the agents' addresses and status files (shared filesystem)
        self.proc: subprocess.Popen | None = None  # the running step, kept until the supervisor's decision
        self.tag = ""
        self._ready_slots: tuple[str, ...] | None = None  # slots whose agents were last ready
        self.no_checkpoint: str | None = None  # why the last launch's agents could rebuild nothing, if so

    def prepare(self) -> None:
        """The rendezvous directory and the per-job secret (0600; kept across relaunches and requeues)."""
        self.rendezvous.mkdir(exist_ok=True)
        job_secret.create(self.job_dir)

    def start(self, layout: Layout, restart_count: int, env: Mapping[str, str]) -> CheckpointError | None:
        """Launch the agents and wait until every one is ready (after a rebuild when the slots changed since
        agents were last ready); None, or why they could not get ready (the step is left for `stop`).

        No snapshot rebuildable on every node (NoCheckpointError) is not a failure of the launch: there is no
        persistent tier yet, so the trainers start from what they can restore (the restore agreement gives
        step 0 when a node holds nothing) and fresh agents, without a rebuild, protect the run from there."""
        rebuild = restart_count > 0 and layout.slots != self._ready_slots
        self.tag, self.no_checkpoint, self.bad_nodes = str(restart_count), None, {}
        self.proc = self._launch(layout, rebuild, env)
        try:
            try:
                ready = self._wait(layout)
            except NoCheckpointError as exc:
                self.no_checkpoint = str(exc)
                self.emit("agents_no_checkpoint", level=logging.WARNING, tag=self.tag, reason=str(exc),
                          action="trainers start from what they can restore; agents relaunched without rebuild")
                self._stop_steps({AGENT_STEP_NAME: self.proc})
                self.tag, rebuild = f"{restart_count}-fresh", False
                self.proc = self._launch(layout, rebuild, env)
                ready = self._wait(layout)
        except CheckpointError as exc:
            self.emit("agents_failed", level=logging.WARNING, tag=self.tag, reason=str(exc))
            return exc
        self._ready_slots = layout.slots
        self.emit("agents_ready", tag=self.tag, rebuild=rebuild, step=ready.step,
                  rebuilt=",".join(layout.slots[i] for i in ready.rebuilt))
        return None

    def _launch(self, layout: Layout, rebuild: bool, env: Mapping[str, str]) -> subprocess.Popen:
        """`srun … python -m hpcft.agent` on the active slots (hpcft.agent.launch), output to the job dir."""
        tag, cfg = self.tag, self.cfg
        for stale in self.rendezvous.glob(f"agent-{tag}-*"):  # a rerun with the same job dir must not meet old ones
            stale.unlink(missing_ok=True)
        root = durable_dir(cfg, self.job_dir)
        persist = PersistConfig(str(root), cfg.persist_every, cfg.persist_keep, cfg.persist_rate) if root else None
        argv = agent_argv(list(layout.slots), rendezvous=str(self.rendezvous), secret=str(self.job_dir / job_secret.NAME),
                          scheme=scheme(cfg), python=self.python, rebuild=rebuild, rate=cfg.protect_rate,
                          cpu_cores=profiles.get(cfg.profile).agent_cpu_cores, persist=persist,
                          lag_bound=cfg.protect_lag, iface=agent_iface(cfg))
        argv += ["--tag", tag]
        self.emit("agents_launch", tag=tag, rebuild=rebuild, slots=",".join(layout.slots), scheme=cfg.protect,
                  group=cfg.group, losses=cfg.losses, distance=cfg.distance)
        with open(self.job_dir / f"agents-{tag}.log", "ab") as log:
            return self.runner.popen(argv, env=dict(env), stdout=log, stderr=subprocess.STDOUT)

    def _wait(self, layout: Layout) -> agent_status.Ready:
        """hpcft.agent.status.wait_ready, in slices so that an agents' step that ended, a node lost (a node the
        agents wait for would hold them until their mesh timeout), a SIGTERM or --protect-timeout end the wait.
        NoCheckpointError as wait_ready; CheckpointError for any other failure."""
        tag, proc = self.tag, self.proc
        deadline = time.monotonic() + self.cfg.protect_timeout
        probe_at = time.monotonic() + PROBE_EVERY_S
        while True:
            try:
                return agent_status.wait_ready(self.rendezvous, tag, len(layout.slots), timeout=self.cfg.poll_interval)
            except NoCheckpointError:
                raise
            except CheckpointError as exc:
                reports = agent_status.read(self.rendezvous, tag).values()
                if any(r.get("phase") == agent_status.FAILED for r in reports):
                    raise
                if time.monotonic() > deadline:
                    raise CheckpointError(f"{exc} (--protect-timeout {self.cfg.protect_timeout:g} s)") from None
            if proc is None or proc.poll() is not None:
                raise CheckpointError(f"the agents' step ended (exit status {proc and proc.returncode}) before every "
                                      f"agent was ready; see {self.job_dir / f'agents-{tag}.log'}")
            if self._interrupted():
                raise CheckpointError("interrupted by SIGTERM")
            probe = time.monotonic() >= probe_at
            self.bad_nodes = self._check_nodes(layout, probe)
            if self.bad_nodes:
                raise CheckpointError("node(s) lost while the agents got ready: " +
                                      "; ".join(f"{n}: {why}" for n, why in self.bad_nodes.items()))
            if probe:
                probe_at = time.monotonic() + PROBE_EVERY_S

    def drain(self, deadline: float) -> str | None:
        """Once the trainers have stopped: ask the agents to protect the newest step without caps, and wait until
        every one reports it protected. None when it is, else why not (their step ended, or `deadline`, a
        time.monotonic() value, passed)."""
        stopped = time.time()
        agent_status.request_drain(self.rendezvous, self.tag)
        while True:
            fresh = [r for r in agent_status.read(self.rendezvous, self.tag).values() if r.get("time", 0) > stopped]
            if fresh and len(fresh) == len(self._ready_slots or ()):
                held = set.intersection(*(set(r.get("staged_steps") or ()) for r in fresh))
                newest = max(held, default=None)
                if newest is None or all((r.get("protected") or -1) >= newest for r in fresh):
                    return None
            if self.proc is None or self.proc.poll() is not None:
                return "the agents' step ended before protecting the newest step"
            if time.monotonic() > deadline:
                return f"the newest step was not protected within --protect-timeout {self.cfg.protect_timeout:g} s"
            time.sleep(min(self.cfg.poll_interval, 0.5))

    def flush(self, deadline: float) -> tuple[int | None, str | None]:
        """Ask the agents to flush the newest protected step to the durable tier and wait until every one reports
        the request served: (the newest durable step, None), or (the newest durable step the agents know of, why
        the flush did not happen) when their step ended or `deadline` (time.monotonic()) passed."""
        rid = agent_persist.request(self.rendezvous, self.tag)
        while True:
            reports = list(agent_status.read(self.rendezvous, self.tag).values())
            served, durable, error = agent_persist.outcome(reports, rid, len(self._ready_slots or ()))
            if served:
                return durable, error
            if self.proc is None or self.proc.poll() is not None:
                return durable, "the agents' step ended before the flush"
            if time.monotonic() > deadline:
                return durable, f"the flush did not finish within --protect-timeout {self.cfg.protect_timeout:g} s"
            time.sleep(min(self.cfg.poll_interval, 0.5))

    def _finish_flush(self) -> None:
        """A flush under way (its drain from node-local storage, which Frontier wipes at the job's end, above all)
        finishes before the agents are stopped, for up to --protect-timeout, unless `hpcft run` got SIGTERM (event
        `flush_wait`)."""
        started = time.monotonic()
        waited = False
        while self.proc is not None and self.proc.poll() is None and not self._interrupted() \
                and time.monotonic() < started + self.cfg.protect_timeout:  # SIGTERM: Slurm's grace is short
            if not any(r.get("flushing") for r in agent_status.read(self.rendezvous, self.tag).values()):
                break
            waited = True
            time.sleep(min(self.cfg.poll_interval, 0.5))
        if waited:
            busy = [r for r in agent_status.read(self.rendezvous, self.tag).values() if r.get("flushing")]
            self.emit("flush_wait", level=logging.WARNING if busy else logging.INFO, done=not busy,
                      seconds=round(time.monotonic() - started, 3))

    def reports(self) -> list[dict]:
        """The running agents' status reports (each node's phase, steps and memory figures); none without agents."""
        return list(agent_status.read(self.rendezvous, self.tag).values()) if self.proc is not None else []

    def protected(self) -> int | None:
        """The newest step every agent of the last launch reports protected, if each reports one."""
        steps = [r.get("protected") for r in agent_status.read(self.rendezvous, self.tag).values()]
        return min(steps) if steps and None not in steps else None

    def stop(self, ask: bool = True, flush: bool = True) -> None:
        """Stop the agents' step of the last launch, if it runs: asked to (each agent exits 0 within a poll, after a
        flush under way when `flush`), for up to --kill-grace, then killed with the step. `ask=False` kills at once
        (a node was lost: the mesh is broken, and recovery must not wait)."""
        if self.proc is None:
            return
        how = "exited" if self.proc.poll() is not None else "asked" if ask else "killed"
        if how == "asked" and flush:
            self._finish_flush()
            agent_status.request_stop(self.rendezvous, self.tag)
            try:
                self.proc.wait(timeout=self.cfg.kill_grace)
            except subprocess.TimeoutExpired:
                how = "killed"
        self._stop_steps({AGENT_STEP_NAME: self.proc})
        self.emit("agents_stopped", exit_code=self.proc.returncode, how=how)
        self.proc = None
