"""Leave nothing in node memory when a job ends, without a site epilog (Frontier users cannot install one): a sleeping
janitor task per node removes the job's store on SIGUSR2 from `hpcft run`, or on Slurm's SIGTERM unless a requeue is
pending (`requeue_flag`, node/clean.py). As Slurm keeps a `--no-kill` job RUNNING with nobody in charge once the
supervisor's node is lost, the janitors after it ping its beacon (launch/node/succession.py); when it is silent for
--loss-timeout and Slurm says its node is bad or gone, the first to claim becomes the supervisor in the same
allocation, or, where no successor can be (`--no-takeover`, salloc's hpcft run), requeues the job
(`event=batch_host_lost`)."""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from hpcft import events
from hpcft.launch.node import succession
from hpcft.errors import HpcftError
from hpcft.launch.node.clean import clean
from hpcft.launch.node.broadcast_paths import ENV_NODE_DIR
from hpcft.launch.node.zygote import socket_dir
from hpcft.launch.node.nodecheck import NodeCheck
from hpcft.launch.policy.state import NAME as STATE, RunState
from hpcft.slurm import state as slurmstate
from hpcft.slurm.state import job_info
from hpcft.slurm.nodelist import compress, expand
from hpcft.slurm.runner import Runner
from hpcft.store.paths import job_dir, resolve_root

_log = logging.getLogger(__name__)
JANITOR_STEP_NAME = "hpcft-janitor"
SILENCE_S = 5.0  # with --loss-timeout 0 (no heartbeats): the supervisor unanswering this long is a suspect
CHECK_S = 1.0  # a watcher's ping period
FAR_CHECK_S = 60.0  # the other janitors' (should the supervisor and its watchers be lost together)
ASK_SLURM_S = 30.0  # while the supervisor is silent on a live node, Slurm is asked at most this often


def requeue(runner: Runner, job: str, exclude: list[str], environ: Mapping[str, str],
            saved: RunState) -> slurmstate.Requeued:
    """Requeue (slurm.state.requeue) with what hpcft put into the job's ExcNodeList before lifted, and what Slurm takes
    now written into `saved` for the next run to lift: `hpcft run`'s and a janitor's requeue alike."""
    done = slurmstate.requeue(runner, job, exclude, int(environ.get("SLURM_JOB_NUM_NODES") or 0),
                              ours=saved.slurm_excluded)
    if not done.unexcluded:  # else the job's ExcNodeList is as it was
        saved.slurm_excluded = done.excluded
    return done


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
    watch = SupervisorWatch(args.job, Path(args.job_dir), run, os.environ.get("SLURMD_NODENAME", ""),
                            expand(os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "")))
    while True:
        time.sleep(watch.period)
        watch.check()


class SupervisorWatch:
    """One janitor's watch of the supervisor (see the module doc): pings over the network at steady state; the job
    directory and Slurm are read only once it is silent."""

    def __init__(self, job: str, job_dir_: Path, run: str, me: str, nodes: list[str],
                 clock: Callable[[], float] = time.monotonic):
        self.job, self.job_dir, self.run, self.me, self.nodes, self.clock = job, job_dir_, run, me, nodes, clock
        self.record = succession.read(job_dir_)  # written before any janitor starts
        self.answered = self._asked = clock()

    @property
    def period(self) -> float:
        watching = self.record is not None and self.me in succession.watchers(self.nodes, self.record.host)
        return CHECK_S if watching else FAR_CHECK_S

    def check(self) -> None:
        now = self.clock()
        if self.record is None:
            return  # an hpcft run of before the beacon: nothing to watch
        if succession.ping(self.record.beacon, self.record.token) is not None:
            self.answered = now
            return
        if now - self.answered < (self.record.loss_timeout or SILENCE_S):
            return
        if self._asked > self.answered and now - self._asked < ASK_SLURM_S:
            return  # Slurm said the silent supervisor's node is alive: asked again later, not at every ping
        fresh = succession.read(self.job_dir)
        if fresh is not None and fresh.generation != self.record.generation:  # a successor took over: watch it
            self.record, self.answered = fresh, now
            return
        self._asked = now
        silent = now - self.answered
        if requeue_flag(self.job_dir, self.run).exists():
            return  # hpcft run requeued the job: its SIGTERM is on its way
        runner, host = Runner(timeout=10), self.record.host
        try:
            if not job_info(runner, self.job).batch:
                return  # salloc: no successor nor requeue (its hpcft run is on a login node)
        except HpcftError:
            return  # Slurm did not answer: ask again later
        # Slurm's view first (out of the job, or marked bad), then a probe beside this node: Slurm may take minutes
        # (SlurmdTimeout) to mark a dead node, and a busy supervisor on a live node answers the probe
        check = NodeCheck(runner, self.job, self.record.env, self.record.probe_timeout, self._emit)
        state = check.bad([host], probe=True, closed=False, found_by="janitor", controls=[self.me] if self.me else ())
        if host not in state:
            return  # a busy supervisor on a live (even drained) node
        generation = self.record.generation + 1
        if not succession.claim(self.job_dir, self.run, generation):
            self.answered = now  # another janitor took it: give its successor time to answer
            return
        _lost(self.job, self.job_dir, self.run, self.record, generation, state[host], silent, self.me)

    def _emit(self, kind: str, **fields) -> None:
        events.emit(kind, log_dir=self.job_dir, job=self.job, **fields)


def _lost(job: str, job_dir_: Path, run: str, record: succession.Record, generation: int, state: str, silent: float,
          me: str) -> None:
    """This janitor claimed the supervision: take it over, or requeue the job where no successor can be."""
    takeover = bool(record.argv) and record.takeover
    events.emit("batch_host_lost", level=logging.ERROR, log_dir=job_dir_, job=job, node=record.host or "?",
                state=state, silent_s=round(silent, 1), generation=generation,
                action="takeover" if takeover else "requeue",
                reason="the supervisor's node is lost and hpcft run with it: "
                       + (f"the janitor of {me or '?'} takes the supervision over (generation {generation})"
                          if takeover else f"requeued by the janitor of {me or '?'}"))
    if takeover:
        try:
            succession.take_over(record, generation, job_dir_ / f"supervisor-{run}-{generation}.log")
        except OSError as exc:
            events.emit("batch_host_lost", level=logging.ERROR, log_dir=job_dir_, job=job, action="takeover_failed",
                        reason=f"{exc}: requeued instead")
    requeue_flag(job_dir_, run).touch()  # every janitor keeps its store through the requeue's SIGTERM
    try:
        _requeue(job, job_dir_, record.host)
    except HpcftError as exc:
        events.emit("batch_host_lost", level=logging.ERROR, log_dir=job_dir_, job=job, action="requeue_failed",
                    reason=str(exc))


def _requeue(job: str, job_dir_: Path, lost: str) -> None:
    """Requeue as `hpcft run` does (slurm.state.requeue): the lost batch host and the nodes the run found bad kept out
    of the next allocation where Slurm still takes them for healthy (it marks a dead node after SlurmdTimeout, often
    minutes, while a requeued job may start seconds later: its batch script could land on the dead node), what
    Slurm took written to state.json for the next run, which lifts it later; event `requeued by=janitor`."""
    path, saved, readable = job_dir_ / STATE, RunState(), True
    try:
        saved = RunState.load(path)
    except HpcftError as exc:  # no reason to keep the job waiting: the next run says what is wrong with the file
        _log.warning("requeuing without the run's state: %s", exc)
        readable = False
    with _sigterm_held():  # the requeue's SIGTERM reaches this step too: state.json first, then the handler
        done = requeue(Runner(timeout=10), job, [n for n in dict.fromkeys([lost, *saved.excluded]) if n], os.environ,
                       saved)
        if readable:
            with contextlib.suppress(OSError):  # a full disk: the next run finds the nodes in ExcNodeList all the same
                saved.save(path)
        events.emit("requeued", level=logging.WARNING, log_dir=job_dir_, job=job, by="janitor", lost=lost,
                    **done.said())


@contextlib.contextmanager
def _sigterm_held() -> Iterator[None]:
    """A SIGTERM that lands in the block waits for its end, then its handler runs."""
    held: list[int] = []
    handler = signal.signal(signal.SIGTERM, lambda signum, _frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, handler)
        if held and callable(handler):
            handler(signal.SIGTERM, None)


if __name__ == "__main__":
    sys.exit(main())
