"""`hpcft run --broadcast-env`, the supervisor's side: the environment packed once per key, sbcast into a
broadcasting step on the nodes not broadcast yet in this run and unpacked there (node/broadcast.py); later steps
start through the chooser (node/broadcast_paths.py): the node's verified copy, else the shared interpreter
(`broadcast_env_failed`)."""
from __future__ import annotations

import contextlib
import getpass
import json
import logging
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from hpcft.errors import ConfigError, HpcftError
from hpcft.launch.steps import broadcast_pack
from hpcft.launch.node import broadcast_paths as paths
from hpcft.launch.config.model import RunConfig
from hpcft.launch.config.profiles import Profile
from hpcft.launch.node.zygote import same_interpreter
from hpcft.env import NVME_ENV
from hpcft.slurm.nodelist import compress
from hpcft.slurm.runner import Runner

BROADCAST_STEP_NAME = "hpcft-broadcast"
READY_TIMEOUT_S = 120.0  # the broadcasting tasks' start (one interpreter each, without torch)
SBCAST_TIMEOUT_S = 1800.0
UNPACK_TIMEOUT_S = 900.0  # unpack and the verifying `import torch`, on every node at once


def wanted(cfg: RunConfig, profile: Profile, environ: Mapping[str, str]) -> tuple[bool, str]:
    """Whether this run broadcasts, and why: the user's setting wins; else the profile's default where the job has
    node-local NVMe ($HPCFT_NVME: Frontier's /mnt/bb/$USER with `hpcft submit --nvme`); else off (pure)."""
    if cfg.broadcast.broadcast_env is not None:
        return cfg.broadcast.broadcast_env, "--broadcast-env" if cfg.broadcast.broadcast_env else "--no-broadcast-env"
    if profile.broadcast_env and environ.get(NVME_ENV):
        return True, f"the {profile.name} profile's default, with node-local NVMe (${NVME_ENV})"
    return False, "off by default"


def broadcast_argv(nodes: Sequence[str], *, python: str, root: Path, job: str, archive: broadcast_pack.Archive,
               spec: broadcast_pack.EnvSpec) -> list[str]:
    """One broadcasting task on each of `nodes`, beside every other step, outliving a lost task or node."""
    n = len(nodes)
    return ["srun", f"--job-name={BROADCAST_STEP_NAME}", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1",
            f"--nodelist={compress(list(nodes))}", "--overlap", "--kill-on-bad-exit=0", "--no-kill", "--export=ALL",
            python, "-m", "hpcft.launch.node.broadcast", "--root", str(root), "--job", job, "--key", archive.key,
            "--bytes", str(archive.bytes), "--crc", str(archive.crc), "--python", spec.python,
            *(["--base-from", str(spec.base)] if spec.base else [])]


def sbcast_argv(job: str, step: str, archive: Path, dest: Path) -> list[str]:
    """The archive to every node of broadcasting step `step` (-C: lz4 on the wire; -f: a leftover is replaced)."""
    return ["sbcast", "-C", "-f", f"--jobid={job}.{step}", str(archive), str(dest)]


class EnvBroadcast:
    """One run's broadcasting. `emit` records events; `python` is the shared interpreter hpcft run was started with."""

    def __init__(self, cfg: RunConfig, profile: Profile, runner: Runner, job_dir: Path, python: str, job_id: str,
                 environ: Mapping[str, str], emit: Callable[..., None]):
        self.on, self.why = wanted(cfg, profile, environ)
        self.runner, self.job_dir, self.shared, self.job, self.emit = runner, job_dir, python, job_id, emit
        self.user = environ.get("USER") or getpass.getuser()
        self.root = paths.broadcast_root(cfg.broadcast.broadcast_dir, environ)
        self.cache = Path(cfg.broadcast.broadcast_cache) if cfg.broadcast.broadcast_cache else job_dir / "broadcast"
        self.node = paths.node_dir(self.root, self.user, job_id)
        self.broadcast: dict[str, bool] = {}  # node → whether its copy is verified, for the nodes tried in this run
        self.archive: broadcast_pack.Archive | None = None
        self.spec: broadcast_pack.EnvSpec | None = None
        self.chooser: Path | None = None

    def env(self) -> dict[str, str]:
        """What the steps are told: where the copy is (the janitors remove it), the interpreter it replaces."""
        return {paths.ENV_NODE_DIR: str(self.node), paths.ENV_SHARED: self.shared} if self.on else {}

    def ensure(self, nodes: Sequence[str], env: dict[str, str], users: Sequence[object]) -> None:
        """Broadcast onto the nodes of `nodes` not tried yet in this run, or tried before a launch that left them out;
        add `env()` to `env`; once a node has a copy, point each of `users`' `.python` (the steps' interpreter) at
        the chooser."""
        if not self.on:
            return
        env.update(self.env())
        # a node left out of this launch (lost, excluded) may come back without its copy (a reboot empties /tmp)
        self.broadcast = {n: ok for n, ok in self.broadcast.items() if n in nodes}
        todo = [n for n in nodes if n not in self.broadcast]
        if todo and self._packed():
            self._broadcast(todo, env)
        elif todo:
            self.broadcast.update({n: False for n in todo})
        if self.chooser is not None and any(self.broadcast.values()):
            for user in users:
                user.python = str(self.chooser)

    def _packed(self) -> bool:
        """The archive of this run's environment (packed at the first call, else reused from the cache)."""
        if self.archive is not None:
            return True
        try:
            if not same_interpreter(self.shared, sys.executable):
                raise ConfigError(f"--broadcast-env packs the environment of the interpreter hpcft run runs in "
                                  f"({sys.executable}), not {self.shared}")
            self.spec = broadcast_pack.describe(self.shared)
            self.archive = broadcast_pack.pack(self.spec, self.cache)
        except (HpcftError, OSError) as exc:
            self.on = False
            self.emit("broadcast_env_failed", level=logging.WARNING, node="*",
                      cause=f"pack: {type(exc).__name__}: {exc}",
                      action="every step starts the shared-FS interpreter")
            return False
        a = self.archive
        self.emit("broadcast_pack", key=a.key, bytes=a.bytes, seconds=a.seconds, reused=a.reused, archive=str(a.path),
                  prefix=str(self.spec.prefix), base="broadcast" if self.spec.base else "shared",
                  editable=",".join(self.spec.editable), why=self.why)
        self.chooser = self.job_dir / f"python-{a.key}"  # names this job's copies: never in a cache jobs share
        text = paths.chooser(self.node, a.key, self.spec.python, self.shared)
        if not self.chooser.exists() or self.chooser.read_text() != text:
            tmp = self.chooser.with_name(f".{self.chooser.name}.tmp")
            tmp.write_text(text)
            tmp.chmod(0o755)
            tmp.replace(self.chooser)
        return True

    def _broadcast(self, nodes: list[str], env: Mapping[str, str]) -> None:
        """One broadcasting of `nodes`: a step, sbcast into it, the go; each node's outcome is an event."""
        started = time.monotonic()
        failed: dict[str, str] = {}
        while True:
            proc, lines = self._step(nodes, env)
            said = _collect(lines, nodes, ("ready", "failed"), READY_TIMEOUT_S)
            failed.update(self._not_ready(nodes, said))
            good = [n for n in nodes if n not in failed]
            if not good or len(good) == len(nodes):
                break
            _end(proc)  # sbcast into a step fails as a whole when one of its nodes refuses: again without those
            nodes = good
        sent, why = self._sbcast() if any(not said[n].get("present") for n in good) else (0.0, "")
        if proc.poll() is None:
            proc.send_signal(signal.SIGUSR1)  # srun passes it on: each task unpacks what arrived
        done = _collect(lines, good, ("done", "failed"), UNPACK_TIMEOUT_S)
        _end(proc, grace=30.0, ask=False)  # its tasks end once they have reported
        for name in good:
            report = done.get(name, {})
            if report.get("phase") != "done":
                failed[name] = (report.get("error") or f"its broadcasting task did not answer (step exit "
                                f"{proc.returncode}; {self.job_dir / 'broadcast.log'})") + (f"; {why}" if why else "")
                continue
            self.broadcast[name] = True
            self.emit("broadcast_env", node=name, bytes=self.archive.bytes, sbcast_s=sent, unpack_s=report["unpack_s"],
                      verify_s=report["verify_s"], seconds=round(time.monotonic() - started, 3),
                      python=report["python"], outside=",".join(report["outside"]), present=bool(report.get("present")))
        for name, cause in failed.items():
            self.broadcast[name] = False
            self.emit("broadcast_env_failed", level=logging.WARNING, node=name, cause=cause,
                      action="this node's steps start the shared-FS interpreter")

    def _step(self, nodes: list[str], env: Mapping[str, str]) -> tuple[subprocess.Popen, queue.Queue]:
        """The broadcasting step on `nodes`, and the queue its tasks' reports arrive on."""
        argv = broadcast_argv(nodes, python=self.shared, root=self.root, job=self.job, archive=self.archive,
                          spec=self.spec)
        with open(self.job_dir / "broadcast.log", "ab") as log:
            proc = self.runner.popen(argv, env=dict(env), stdout=subprocess.PIPE, stderr=log, text=True)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_read, args=(proc.stdout, lines), daemon=True).start()
        return proc, lines

    def _not_ready(self, nodes: Sequence[str], said: Mapping[str, dict]) -> dict[str, str]:
        """{node: why it cannot be broadcast} from the tasks' first reports: refused, silent, or a root shared."""
        shared = {n for n, r in said.items() if r.get("shared_with")} | \
            {m for r in said.values() for m in r.get("shared_with", [])}
        why = {}
        for name in nodes:
            report = said.get(name)
            if report is None:
                why[name] = (f"its broadcasting task did not start within {READY_TIMEOUT_S:g} s "
                             f"({self.job_dir / 'broadcast.log'})")
            elif report["phase"] == "failed":
                why[name] = report["error"]
            elif name in shared:
                why[name] = (f"{self.root} is not node-local: the broadcast's tasks of {', '.join(sorted(shared))} see "
                             f"each other's files there (set --broadcast-dir to a node-local directory)")
        return why

    def _sbcast(self) -> tuple[float, str]:
        """sbcast the archive into the broadcasting step just started: (seconds, "" or what sbcast said)."""
        started = time.monotonic()
        try:
            listed = self.runner.run(["squeue", "-h", "-s", "-j", self.job, "-o", "%i %j"]).stdout
            steps = [line.split()[0].split(".")[-1] for line in listed.splitlines()
                     if line.split()[1:] == [BROADCAST_STEP_NAME]]
            if not steps:
                return 0.0, "the broadcasting step is not in squeue"
            step = max(steps, key=lambda s: int(s) if s.isdigit() else -1)
            dest = paths.archive_dest(self.root, self.user, self.job)
            self.runner.run(sbcast_argv(self.job, step, self.archive.path, dest), timeout=SBCAST_TIMEOUT_S)
        except HpcftError as exc:
            return round(time.monotonic() - started, 3), str(exc)[-400:]
        return round(time.monotonic() - started, 3), ""


def _collect(lines: queue.Queue, nodes: Sequence[str], phases: tuple[str, ...], timeout: float) -> dict[str, dict]:
    """{node: its last report in one of `phases`} until every one of `nodes` has one, the step ended or `timeout`."""
    found: dict[str, dict] = {}
    deadline = time.monotonic() + timeout
    while set(nodes) - set(found):
        try:
            report = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        if report is None:
            lines.put(None)  # the step's output ended: so will every later wait
            break
        if report.get("phase") in phases:
            found[report["node"]] = report
    return found


def _read(stream, lines: queue.Queue) -> None:
    """The broadcasting tasks' JSON lines onto `lines`, then None when the step's output ends."""
    for line in stream:
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                lines.put(json.loads(line))
    lines.put(None)


def _end(proc: subprocess.Popen, grace: float = 5.0, ask: bool = True) -> None:
    """The broadcasting step ended: asked first when `ask` (SIGTERM, which srun passes on), killed after `grace`."""
    if ask and proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
