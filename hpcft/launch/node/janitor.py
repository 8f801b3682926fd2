"""Leave nothing in node memory when a job ends, without a site epilog (Frontier users cannot install one): a sleeping
janitor task per node removes the job's store on SIGUSR2 from `hpcft run`, or on Slurm's SIGTERM unless a requeue is
pending (`requeue_flag`, node/clean.py). As Slurm keeps a `--no-kill` job RUNNING with nobody in charge once the batch
host is lost, a janitor requeues the job when `supervisor.alive` is silent for SILENCE_S and Slurm says that host is bad
or gone (`event=batch_host_lost`)."""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from hpcft import events
from hpcft.errors import HpcftError
from hpcft.launch.node.clean import clean
from hpcft.launch.node.broadcast_paths import ENV_NODE_DIR
from hpcft.launch.node.zygote import socket_dir
from hpcft.slurm.state import is_lost, job_info, node_states
from hpcft.slurm.nodelist import compress
from hpcft.slurm.runner import Runner
from hpcft.store.paths import job_dir, resolve_root

JANITOR_STEP_NAME = "hpcft-janitor"
SILENCE_S = 15.0  # the supervisor's heartbeat this much older, and the batch host bad: it is lost
CHECK_S = 2.0


def heartbeat_path(job_dir_: str | os.PathLike) -> Path:
    return Path(job_dir_) / "supervisor.alive"


def start_heartbeat(job_dir_: str | os.PathLike, interval: float = 1.0) -> None:
    """Touch the heartbeat file every `interval` s from a daemon thread of `hpcft run` (alive while it is)."""
    path = heartbeat_path(job_dir_)

    def beat() -> None:
        while True:
            with contextlib.suppress(OSError):  # the shared filesystem hiccups: the janitors allow SILENCE_S
                path.touch()
            time.sleep(interval)

    threading.Thread(target=beat, daemon=True, name="hpcft-heartbeat").start()


def requeue_flag(job_dir_: str | os.PathLike, run: int | str) -> Path:
    """Written by `hpcft run` before it requeues run `run` (Slurm's restart count) of the job: keep the stores."""
    return Path(job_dir_) / f"requeue-run-{run}"


def janitor_argv(nodes: Sequence[str], *, python: str, job_dir_: str, now: bool = False,
                 env_copy: bool = False) -> list[str]:
    """One janitor task on each of `nodes`, beside the job's other steps (--overlap), outliving a lost task
    (--kill-on-bad-exit=0) or node (--no-kill: without it slurmctld kills the step when it marks the batch host DOWN,
    and the janitors raced that mark, losing 2 runs in 4 under load)."""
    n = len(nodes)
    return ["srun", f"--job-name={JANITOR_STEP_NAME}", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1",
            f"--nodelist={compress(list(nodes))}", "--overlap", "--kill-on-bad-exit=0", "--no-kill", "--export=ALL",
            python, "-m", "hpcft.launch.node.janitor", "--job-dir", str(job_dir_), *(["--now"] if now else []),
            *(["--env-copy"] if env_copy else [])]


class Janitor:
    """The supervisor's side: one janitor step per run of the job, kept running (`ensure`, at every launch, in
    case a node loss ended it), and the final clean-up on every node once the job ends on its own (`finish`)."""

    def __init__(self, runner: Runner, job_dir_: Path, python: str, stop_steps: Callable[[Mapping], None]):
        self.runner, self.job_dir, self.python, self._stop_steps = runner, job_dir_, python, stop_steps
        self.proc: subprocess.Popen | None = None
        self.nodes: list[str] = []  # where the waiting janitors of `proc` run
        self.cleaned_by = ""  # how the last `finish` removed the stores: "janitors" (signalled) or "--now step"
        self.env_copy: dict[str, str] = {}  # where the nodes' copies of the environment are (--broadcast-env)

    def _popen(self, nodes: Sequence[str], env: Mapping[str, str], now: bool,
               env_copy: bool = False) -> subprocess.Popen:
        with open(self.job_dir / "janitor.log", "ab") as log:
            argv = janitor_argv(nodes, python=self.python, job_dir_=str(self.job_dir), now=now, env_copy=env_copy)
            return self.runner.popen(argv, env={**env, **self.env_copy}, stdout=log, stderr=subprocess.STDOUT)

    def ensure(self, nodes: Sequence[str], env: Mapping[str, str]) -> None:
        self.env_copy = {ENV_NODE_DIR: env[ENV_NODE_DIR]} if env.get(ENV_NODE_DIR) else {}
        if self.proc is None or self.proc.poll() is not None:
            self.proc, self.nodes = self._popen(nodes, env, now=False), list(nodes)

    def finish(self, nodes: Sequence[str], env: Mapping[str, str], timeout: float = 60.0,
               signalled_s: float = 10.0) -> int | None:
        """The job is over: remove the store on every one of `nodes`; srun's exit status (None: it did not finish
        within `timeout`). The waiting janitors do it when they cover `nodes` (SIGUSR2, up to `signalled_s`): no
        new step, no second interpreter start per node; else they are stopped and a `--now` step does it."""
        if self.proc is not None and self.proc.poll() is None and set(nodes) <= set(self.nodes):
            self.proc.send_signal(signal.SIGUSR2)
            try:
                if self.proc.wait(timeout=signalled_s) == 0:
                    self.proc, self.cleaned_by = None, "janitors"
                    return 0
            except subprocess.TimeoutExpired:
                pass
        if self.proc is not None:
            self._stop_steps({JANITOR_STEP_NAME: self.proc})
            self.proc = None
        self.cleaned_by = "--now step"
        return self.wipe(nodes, env, timeout, env_copy=True)

    def wipe(self, nodes: Sequence[str], env: Mapping[str, str], timeout: float = 60.0,
             env_copy: bool = False) -> int | None:
        """Remove the job's store (with `env_copy` the environment's copy too) on `nodes`; srun's status, None if
        late."""
        proc = self._popen(nodes, env, now=True, env_copy=env_copy)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return None


def _remove(store: Path, settle: float = 1.0) -> bool:
    """Remove the store, and again if a process of the job that was still dying wrote into it meanwhile."""
    removed = False
    for _ in range(2):
        if store.exists():
            shutil.rmtree(store, ignore_errors=True)
            removed = True
        time.sleep(settle)
    return removed and not store.exists()


def _remove_standby(job: str) -> None:
    """The job's standby socket directory a killed standby left on this node: no later run uses it."""
    with contextlib.suppress(HpcftError):
        shutil.rmtree(socket_dir(job), ignore_errors=True)


def _remove_env_copy() -> None:
    """This node's environment copy (made again from the archive), renamed first: no step starts a half-removed one."""
    copy = os.environ.get(ENV_NODE_DIR)
    if not copy:
        return
    trash = f"{copy}.removed-{os.getpid()}"
    try:
        os.rename(copy, trash)
    except OSError:
        pass  # none here, or one being removed by a janitor stopped meanwhile: its leftover is removed below
    for left in [copy, *Path(copy).parent.glob(Path(copy).name + ".removed-*")]:
        shutil.rmtree(left, ignore_errors=True)
    for probe in Path(copy).parent.glob(f".{Path(copy).name}.node-*"):  # the broadcast's node tasks' probes
        probe.unlink(missing_ok=True)


def _on_sigterm(job: str, store: Path, flag: Path) -> None:
    """Slurm ends or requeues the job: remove the store unless a requeue is pending."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _remove_standby(job)
    if flag.exists():
        why = f"kept: hpcft run requeued the job ({flag})"
    else:
        try:
            path, removed, why = clean(job, runner=Runner(timeout=10), keep_unknown=True)
            if removed:
                _remove(path)
        except HpcftError as exc:  # never drop a checkpoint on a guess
            why = f"kept: {exc}"
    print(f"hpcft janitor: {store}: {why}", file=sys.stderr)
    _remove_env_copy()  # after the store: Slurm's KillWait bounds what a janitor does here
    os._exit(0)


def _on_done(job: str, store: Path) -> None:
    """`hpcft run` says the job is over (Janitor.finish): remove the store now, as `--now` does, and exit."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _remove_standby(job)
    _remove(store, settle=0.2)
    _remove_env_copy()
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpcft.launch.node.janitor", description=__doc__)
    ap.add_argument("--job", default=os.environ.get("SLURM_JOB_ID"), help="job id (default $SLURM_JOB_ID)")
    ap.add_argument("--job-dir", required=True, help="hpcft run's job directory (where it flags its own requeues)")
    ap.add_argument("--now", action="store_true", help="the job is over: remove its store at once and exit")
    ap.add_argument("--env-copy", action="store_true", help="with --now: also this node's copy of the environment")
    args = ap.parse_args(argv)
    if not args.job:
        print("hpcft janitor: no job id (--job or $SLURM_JOB_ID)", file=sys.stderr)
        return 2
    try:
        store = job_dir(resolve_root(), args.job)
    except HpcftError as exc:
        print(f"hpcft janitor: {exc}", file=sys.stderr)
        return 1
    if args.now:
        _remove(store, settle=0.2)
        if args.env_copy:
            _remove_env_copy()
        return 0
    run = os.environ.get("SLURM_RESTART_COUNT", "0") or "0"
    flag = requeue_flag(args.job_dir, run)
    signal.signal(signal.SIGTERM, lambda *_: _on_sigterm(args.job, store, flag))
    signal.signal(signal.SIGUSR2, lambda *_: _on_done(args.job, store))
    while True:
        time.sleep(CHECK_S)
        _watch_supervisor(args.job, Path(args.job_dir), run, flag)


def _silent_for(job_dir_: Path) -> float:
    try:
        return time.time() - heartbeat_path(job_dir_).stat().st_mtime
    except FileNotFoundError:
        return 0.0  # no heartbeat yet (an older hpcft run, or not started): nothing to judge


def _watch_supervisor(job: str, job_dir_: Path, run: str, flag: Path) -> None:
    """Requeue the job when the supervisor is silent and its node is lost (see the module doc)."""
    silent = _silent_for(job_dir_)
    if silent < SILENCE_S or flag.exists():
        return
    runner = Runner(timeout=10)
    try:
        info = job_info(runner, job)
        host = info.batch_host
        state = node_states(runner, [host]).get(host, "UNKNOWN") if host else "UNKNOWN"
    except HpcftError:
        return  # Slurm did not answer: ask again at the next check
    if not info.batch or (host in info.nodes and not is_lost(state)):
        return  # salloc (nothing to requeue), or a slow disk or busy supervisor on a live (even drained) batch host
    try:  # one janitor acts: the first to create the claim
        os.close(os.open(job_dir_ / f"batch-host-lost-run-{run}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return
    flag.touch()  # every janitor keeps its store through the requeue's SIGTERM
    events.emit("batch_host_lost", level=logging.ERROR, log_dir=job_dir_, job=job, node=host or "?", state=state,
                silent_s=round(silent, 1), action="requeue", reason="the supervisor's node is lost and hpcft run "
                "with it: requeued by the janitor of " + os.environ.get("SLURMD_NODENAME", "?"))
    try:
        runner.run(["scontrol", "requeue", job])
    except HpcftError as exc:
        events.emit("batch_host_lost", level=logging.ERROR, log_dir=job_dir_, job=job, action="requeue_failed",
                    reason=str(exc))


if __name__ == "__main__":
    sys.exit(main())
