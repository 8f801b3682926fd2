"""How a bench runs its job in the sandbox: the sandbox (given or started), its logs kept on failure, `hpcft run`
under salloc or `hpcft submit`, and the run's end. The recovery, lag, control and chaos benches share it."""
from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from hpcft.bench import timeline
from hpcft.bench.timeline import ACTIVE, JOB
from hpcft.errors import ConfigError, HpcftError

SPARES = 2


@contextlib.contextmanager
def sandbox(directory: str | None, nodes: int = ACTIVE + SPARES, idle: int = 0) -> Iterator[Any]:
    """The sandbox at `directory` (must be up, with at least `nodes` nodes), or a fresh one of `nodes` + `idle` nodes in
    a temp dir, stopped afterwards."""
    from hpcft.sandbox import Sandbox, SandboxConfig
    from hpcft.sandbox.cluster import ensure_up

    if directory:
        sb = Sandbox.load(directory)
        if not sb.is_up():
            raise ConfigError(f"no sandbox running in {directory}; start one with `hpcft sandbox up` or omit --dir")
        if len(sb.node_names) < nodes:
            raise ConfigError(f"the sandbox in {directory} has {len(sb.node_names)} nodes; the bench needs "
                              f"{nodes} (`hpcft sandbox up --nodes {nodes}`)")
        yield sb
        return
    with tempfile.TemporaryDirectory(prefix="hpcft-bench-sandbox-", ignore_cleanup_errors=True) as own:
        sb, _ = ensure_up(SandboxConfig(dir=Path(own), nodes=nodes + idle), timeout=60)
        try:
            yield sb
        finally:
            sb.down()


def keep_logs(sb: Any, into: Path) -> list[Path]:
    """Copy the sandbox's logs (slurmctld, every slurmd, munged) into `into`; the copies made (best effort: a log
    that cannot be read is skipped, the failure being reported is the bench's own)."""
    into.mkdir(parents=True, exist_ok=True)
    kept = []
    for log in sb.log_files():
        with contextlib.suppress(OSError):
            kept.append(Path(shutil.copy2(log, into / log.name)))
    return kept


@contextlib.contextmanager
def measured(directory: str | None, nodes: int, keep: str | None, prefix: str) -> Iterator[tuple[Any, Path]]:
    """(sandbox, work dir) for a bench's sandbox run: the sandbox healed before and after, its logs kept in the work
    dir on failure and the error naming that dir; the work dir removed after a success unless `keep` named it."""
    with sandbox(directory, nodes=nodes) as sb:  # a sandbox that is not there: its error alone, no work dir made
        work = Path(keep) if keep else Path(tempfile.mkdtemp(prefix=prefix))
        work.mkdir(parents=True, exist_ok=True)
        os.chmod(work, 0o755)
        try:
            sb.heal()
            try:
                yield sb, work
            except HpcftError:
                keep_logs(sb, work / "sandbox-logs")
                raise
            finally:
                sb.heal()
        except HpcftError as exc:
            raise HpcftError(f"{exc} (the run's output is kept in {work})") from exc
    if not keep:
        shutil.rmtree(work, ignore_errors=True)


def allocation(sb: Any, opts: Any, out: Path, salloc: Sequence[str], *options: str, **env: str) -> subprocess.Popen:
    """`salloc -N4 --no-kill -t 30 SALLOC… hpcft run --spares 0 OPTIONS… -- python train_job.py` in the sandbox, in a
    session of its own (`end_allocation` ends it), its output in OUT/run.log."""
    argv = ["salloc", f"-N{ACTIVE}", *salloc, "--no-kill", "-t", "30",
            *hpcft_argv("run", opts, out, "--spares", "0", *options)]
    return sb.runner().popen(argv, env=timeline.job_env(opts, out, **env), stdout=open(out / "run.log", "ab"),
                             stderr=subprocess.STDOUT, start_new_session=True)


def end_allocation(proc: subprocess.Popen) -> None:
    """End an `salloc` started in its own session: SIGTERM (salloc ends the allocation, hpcft run its steps), SIGKILL
    after 60 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def hpcft_argv(command: str, opts: Any, out: Path, *options: str) -> list[str]:
    """`hpcft COMMAND` (run or submit) of the bench job with the bench's supervisor options and `options`."""
    out.mkdir(parents=True, exist_ok=True)
    return [sys.executable, "-m", "hpcft.cli", command, "--job-dir", str(out / "job"), "--poll-interval",
            str(opts.poll_interval), "--kill-grace", str(opts.kill_grace), "--probe-timeout", str(opts.probe_timeout),
            "--requeue-margin", "30", *options, "--", sys.executable, str(JOB)]


def supervised(sb, opts: Any, out: Path, *options: str, **env: str) -> subprocess.Popen:
    """`salloc -N6 --no-kill hpcft run --spares 2 … OPTIONS -- python train_job.py` in the sandbox, its time limit
    the run's --timeout (15 minutes at least)."""
    argv = ["salloc", f"-N{ACTIVE + SPARES}", "--no-kill", "-t", str(max(15, math.ceil(opts.timeout / 60))),
            *hpcft_argv("run", opts, out, "--spares", str(SPARES), "--lost-progress-exit", "0", *options)]
    # --lost-progress-exit 0: a recovery redoes the steps past its snapshot, which the bench measures
    return sb.runner().popen(argv, env=timeline.job_env(opts, out, **env), stdout=open(out / "run.log", "ab"),
                             stderr=subprocess.STDOUT)


def submit(sb, opts: Any, out: Path, *options: str, **env: str) -> str:
    """`hpcft submit OPTIONS -- python train_job.py` into the sandbox (USR1 60 s before the walltime, no module, the
    output in OUT/job.out); the job id."""
    argv = hpcft_argv("submit", opts, out, "--warn", "60", "--module", "", "-o", str(out / "job.out"), *options)
    environ = {**sb.client_env(), **timeline.job_env(opts, out, **env)}
    environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{environ.get('PATH', '')}"  # it runs `hpcft run`
    job = subprocess.run(sb.client_prefix() + argv, env=environ, capture_output=True, text=True, timeout=60, cwd=out)
    if job.returncode != 0:
        raise HpcftError(f"hpcft submit failed: {job.stderr.strip()}")
    return job.stdout.strip()


def finish(proc: subprocess.Popen, out: Path, timeout: float) -> None:
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise HpcftError(f"the run in {out} did not finish within {timeout:g} s; see {out / 'run.log'}") from None
    if code != 0:
        tail = (out / "run.log").read_text(errors="replace")[-3000:]
        raise HpcftError(f"the run in {out} ended with exit status {code}:\n{tail}")
