"""The supervisor's side of the warm standbys: one step of its own per run, one standby task on every node of the
slots and spares, started before the first launch's agents and waited for (their import overlaps the agents' start),
started again at a later launch if a node loss ended the step, stopped at the end."""
from __future__ import annotations

import contextlib
import json
import logging
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from hpcft.launch.node.standby import STATUS_DIR, active_ready_path, status_path
from hpcft.launch.node.zygote import ENV_STANDBY
from hpcft.slurm.nodelist import compress
from hpcft.slurm.runner import Runner

_log = logging.getLogger(__name__)
STANDBY_STEP_NAME = "hpcft-standby"
READY_TIMEOUT_S = 120.0  # the standbys' import (torch's, under load); past it the trainers of the late nodes go cold
# a spare's standby, waited for at a later launch, imports behind the active ones: once it is this many times their
# import late, a cold start costs no more than waiting on (and a standby that cannot write its status is not waited
# for 120 s: a full job directory)
SPARE_WAIT_FACTOR, SPARE_WAIT_FLOOR_S = 2.0, 10.0


def cpus_per_node(environ: Mapping[str, str]) -> int | None:
    """The fewest CPUs any node of the allocation has (SLURM_JOB_CPUS_PER_NODE, e.g. `56(x4),28`), or None."""
    counts = []
    for part in (environ.get("SLURM_JOB_CPUS_PER_NODE") or "").split(","):
        try:
            counts.append(int(part.split("(")[0]))
        except ValueError:
            return None
    return min(counts) if counts else None


def standby_argv(nodes: Sequence[str], *, python: str, job_dir: str, preload: str,
                 cpus: int | None = None, spares: Sequence[str] = (), since: float | None = None) -> list[str]:
    """One standby on each of `nodes`, beside every other step and outliving a lost task or node; the node's CPUs
    unbound, so that a child can take its rank's task's affinity (a step's cpuset bounds its processes). Those of
    `spares` import behind the active ones until `wait` has them ready (its marker touched at or after `since`)."""
    n = len(nodes)
    return ["srun", f"--job-name={STANDBY_STEP_NAME}", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1",
            f"--nodelist={compress(list(nodes))}", "--overlap", "--kill-on-bad-exit=0", "--no-kill", "--export=ALL",
            *([f"--cpus-per-task={cpus}"] if cpus else []), "--cpu-bind=none",
            python, "-m", "hpcft.launch.node.standby", "--job-dir", job_dir, "--preload", preload,
            *(["--spares", compress(list(spares)), "--since", f"{since or 0:.3f}"] if spares else [])]


def read_status(job_dir: Path, nodes: Sequence[str], since: float) -> dict[str, dict]:
    """{node: its standby's status} written after `since` (wall clock), for the nodes that have one."""
    found = {}
    for node in nodes:
        try:
            report = json.loads(status_path(job_dir, node).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if report.get("time", 0) >= since:
            found[node] = report
    return found


class Standbys:
    """One job's standby step. `emit` records events, `stop_steps` stops {step name: srun} (the supervisor's)."""

    def __init__(self, runner: Runner, job_dir: Path, python: str, preload: str, environ: Mapping[str, str], *,
                 emit: Callable[..., None], stop_steps: Callable[[Mapping[str, subprocess.Popen]], None],
                 enabled: bool = True):
        self.runner, self.job_dir, self.python, self.preload = runner, job_dir, python, preload
        self.enabled = enabled  # --standby: without it `ensure` and `wait` do nothing and every rank starts cold
        self.cpus = cpus_per_node(environ)
        self.emit, self._stop_steps = emit, stop_steps
        self.proc: subprocess.Popen | None = None
        self.nodes: list[str] = []
        self._since = 0.0
        self._seen: set[str] = set()  # the nodes of the running step whose standby was waited for (`wait`)
        self._import_s = 0.0  # the slowest import the first wait of the running step saw (bounds a spare's wait)
        self.adopted: list[str] = []  # a lost supervisor's standby step(s), left running for their warm processes

    def ensure(self, nodes: Sequence[str], env: Mapping[str, str], spares: Sequence[str] = ()) -> None:
        """A standby step on `nodes` unless one runs; `spares` import at the lowest priority."""
        if not self.enabled or self.adopted or (self.proc is not None and self.proc.poll() is None):
            return
        if self.proc is not None:
            self.emit("standby_failed", level=logging.WARNING, cause="step_ended", exit_code=self.proc.returncode,
                      nodes=",".join(self.nodes), action="started again on " + compress(list(nodes)))
        (self.job_dir / STATUS_DIR).mkdir(exist_ok=True)
        self._since, self.nodes, self._seen, self._import_s = time.time(), list(nodes), set(), 0.0
        argv = standby_argv(nodes, python=self.python, job_dir=str(self.job_dir), preload=self.preload,
                            cpus=self.cpus, spares=spares, since=self._since)
        with open(self.job_dir / "standby.log", "ab") as log:
            self.proc = self.runner.popen(argv, env=dict(env), stdout=log, stderr=subprocess.STDOUT)
        self.emit("standby_launch", nodes=compress(list(nodes)), preload=self.preload)

    def wait(self, nodes: Sequence[str], timeout: float = READY_TIMEOUT_S,
             interrupted: Callable[[], bool] = lambda: False) -> dict[str, dict]:
        """After `ensure` started a step: until each of `nodes` not waited for before has a standby ready or failed
        (their statuses), the step ended, `timeout` passed or `interrupted()`; one `standby_wait` event says how it
        went (WARNING when a node has none). A spare given a slot is waited for at that launch: its standby imports
        behind the active ones', and a rank started cold would import as long (so for SPARE_WAIT_FACTOR × their
        import at most). Nodes waited for once are not again (their standbys are up, or said not to be): {} at once."""
        nodes = [n for n in nodes if n not in self._seen and n in self.nodes]  # a node the step has not: none comes
        if not self.enabled or self.proc is None or not nodes:
            return {}
        first, started = not self._seen, time.monotonic()
        if not first and self._import_s:
            timeout = min(timeout, max(SPARE_WAIT_FLOOR_S, SPARE_WAIT_FACTOR * self._import_s))
        self._seen.update(nodes)
        while True:
            found = read_status(self.job_dir, nodes, self._since)
            if len(found) == len(nodes) or self.proc is None or self.proc.poll() is not None \
                    or time.monotonic() > started + timeout or interrupted():
                break
            time.sleep(0.2)
        try:  # the spares' standbys import behind these until now (standby._preload_behind)
            if first:
                active_ready_path(self.job_dir).touch()
        except OSError as exc:
            _log.warning("cannot tell the spares' standbys that the active ones are up: %s", exc)
        ready = sorted(n for n, r in found.items() if r.get("phase") == "ready")
        if first:
            self._import_s = max((found[n].get("import_s") or 0.0 for n in ready), default=0.0)
        missing = [n for n in nodes if n not in ready]
        why = "; ".join(f"{n}: {found[n].get('error')}" if n in found else
                        f"{n}: no standby ready (its step {'ended' if self.proc.poll() is not None else 'is late'})"
                        for n in missing)
        self.emit("standby_wait", level=logging.WARNING if missing else logging.INFO, ready=len(ready),
                  nodes=len(nodes), seconds=round(time.monotonic() - started, 3),
                  import_s=max((r.get("import_s", 0) for r in found.values()), default=None),
                  **({"reason": why, "action": "these nodes' trainers start cold"} if missing else {}))
        return found

    def adopt(self, steps: Sequence[str]) -> None:
        """A successor keeps the standby step (ids in `steps`, as squeue lists them) its lost predecessor started: its
        standbys on the live nodes are warm, where a new step would import for seconds; a node without one starts its
        trainers cold."""
        self.adopted = list(steps) if self.enabled else []

    def env(self) -> dict[str, str]:
        """What the trainers' tasks are told: whether to hand themselves to a standby (hpcft.launch.node.warm)."""
        return {ENV_STANDBY: "1" if self.enabled else "0"}

    def stop(self, asked_s: float = 2.0) -> None:
        """Stop the standby step: SIGUSR2 first (each removes its socket), after `asked_s` the supervisor's; an
        adopted one, whose srun died with its supervisor, through Slurm."""
        if self.adopted:
            self.runner.run(["scancel", "--signal=USR2", *self.adopted], check=False)
            self.adopted = []
            self.emit("standby_stopped", exit_code=None, adopted=True)
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR2)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=asked_s)
        self._stop_steps({STANDBY_STEP_NAME: self.proc})
        self.emit("standby_stopped", exit_code=self.proc.returncode)
        self.proc = None
