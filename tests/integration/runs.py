"""What the sandbox tests of `hpcft run` share: the DP job, waiting on its progress and on the agents' protection,
and comparing its final parameters with an uninterrupted run's."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hpcft import events
from hpcft.agent import status as agent_status
from hpcft.bench import train_job
from hpcft.launch.node import progress
from hpcft.slurm.state import fields

JOB = Path(train_job.__file__)  # the DP job shared with `hpcft bench recovery`
STEPS = 16
FAULT_AT = 6  # the session's recovery bench (conftest.py) faults once every rank has completed this step


def wait(predicate, what: str, timeout: float, story: Path | None = None) -> None:
    """Poll `predicate` until true; on timeout fail, with the job's story when `story` (its output dir) is given."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}" + (told(story) if story else ""))
        time.sleep(0.1)


def told(out: Path, events_kept: int = 40, lines_kept: int = 60) -> str:
    """What a job in `out` said (its newest events and output lines and its agents' status), for a failure."""
    recs = events.read(out / "job") if (out / "job").is_dir() else []
    t0 = recs[0]["time"] if recs else 0.0  # each event's time since the job's first, to tell what waited on what
    said = [f"+{e.get('time', t0) - t0:.1f}s "
            + " ".join(f"{k}={v}" for k, v in e.items() if k not in ("time", "job"))[:300] for e in recs[-events_kept:]]
    log = out / "job.out"
    lines = log.read_text(errors="replace").splitlines()[-lines_kept:] if log.exists() else ["(no job.out)"]
    agents = {tag: agent_status.read(out / "job" / "agents", tag) for tag in "0123"}
    logs = sorted((out / "job").glob("agents-*.log"), key=lambda p: p.stat().st_mtime)[-2:]  # what srun said of them
    steps = [f"{p.name}:\n" + "\n".join(p.read_text(errors="replace").splitlines()[-lines_kept // 3:]) for p in logs]
    successors = [f"{p.name}:\n" + "\n".join(p.read_text(errors="replace").splitlines()[-lines_kept // 3:])
                  for p in sorted((out / "job").glob("supervisor-*.log"))]  # a successor's output (a lost batch host)
    return ("\n--- events ---\n" + "\n".join(said) + "\n--- job.out ---\n" + "\n".join(lines + successors)
            + "\n--- agents ---\n" + "\n".join(f"{t}: {s}" for t, s in agents.items() if s)
            + "\n--- agents' steps ---\n" + "\n".join(steps))


def wait_progress(job_dir: Path, rank: int, step: int, timeout: float = 90) -> None:
    """Until `rank` has reported `step` to the supervisor."""
    wait(lambda: progress.read(job_dir).get(rank, (-1, 0))[0] >= step, f"rank {rank} to report step {step}", timeout)


def wait_protected(out: Path, tag: str | None = None, slots: int = 4, timeout: float = 90,
                   above: int | None = None) -> int:
    """The step every agent of launch `tag` (default: `newest_ready`) has protected, once it is at most one snapshot
    behind the newest the trainers completed (> 0): their store keeps two versions, so an older protected step may
    be recycled before a crash. Progress first, then the agents' status (rewritten once per round). With `above`: once every agent
    has protected a step newer than `above`, however far the trainers are ahead (an agent keeps its newest
    protected step pinned, so a crash still finds it; catching up with trainers faster than a protection round
    may never happen)."""
    found: list = []

    def caught_up() -> bool:
        newest = max((int(p.read_text() or -1) for p in out.glob("progress.*")), default=-1) if above is None \
            else above + 1
        ready = newest_ready(out / "job") if tag is None else tag
        found[:] = [s.get("protected") for s in agent_status.read(out / "job" / "agents", ready).values()] \
            if ready else []
        return len(found) == slots and all(d is not None and d > 0 and d >= newest for d in found)

    wait(caught_up, f"the agents of launch {tag or '(the newest ready)'} to keep up", timeout, story=out)
    return min(found)


def newest_ready(job_dir: Path) -> str | None:
    """The tag of the newest launch whose agents got ready (a first launch's is "0", or "0-again" when its agents'
    step had to be launched twice), if any."""
    return next((e["tag"] for e in reversed(events.read(job_dir)) if e["event"] == "agents_ready"), None)


def agents_ready(job_dir: Path, tag: str) -> dict | None:
    """The supervisor's `agents_ready` event of launch `tag`, once there is one."""
    return next((e for e in events.read(job_dir) if e["event"] == "agents_ready" and e["tag"] == tag), None)


def final(out: Path) -> dict:
    return torch.load(out / "final.pt", weights_only=True)


def assert_same_result(out: Path, ref: Path) -> None:
    got, want = final(out), final(ref)
    assert got["seen"] == want["seen"]
    assert got["params"].keys() == want["params"].keys()
    differ = [name for name, tensor in want["params"].items() if not torch.equal(got["params"][name], tensor)]
    assert not differ, f"parameters {differ} differ from the uninterrupted run"


def decisions(job_dir: Path) -> list[dict]:
    return [e for e in events.read(job_dir) if e["event"] == "decision"]


def resumed_from(out: Path) -> dict[str, int]:
    """{start file: step} of every launch that resumed from a snapshot (step > 0)."""
    return {p.name: int(p.read_text()) for p in out.glob("start.*") if int(p.read_text()) > 0}


def start(sandbox, out: Path, allocate: int, *args: str, per_node: int = 1, steps: int = STEPS, delay: float = 0.0,
          verbose: bool = True, minutes: int = 5, python: str = sys.executable, job: Path = JOB,
          salloc: tuple[str, ...] = (), **env: str) -> subprocess.Popen:
    """`salloc -N<allocate> --ntasks-per-node=<per_node> [SALLOC] --no-kill -t <minutes> python -m hpcft.cli [-v] run
    ARGS -- python train_job.py` (or `job`) in the sandbox, at once (without -v, the job output is what a person reads
    by default); `python`: the interpreter of both, this one by default."""
    out.mkdir(parents=True, exist_ok=True)
    env = {"OUT": str(out), "STEPS": str(steps), "STEP_DELAY": str(delay), "PYTHONUNBUFFERED": "1", **env}
    argv = ["salloc", f"-N{allocate}", f"--ntasks-per-node={per_node}", *salloc, "--no-kill", "-t", str(minutes),
            python, "-m",
            "hpcft.cli", *(["-v"] if verbose else []), "run", "--job-dir", str(out / "job"), "--poll-interval", "0.5", "--kill-grace", "1", "--probe-timeout", "5",
            "--requeue-margin", "30", *args, "--", python, str(job)]
    return sandbox.runner().popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finished_ok(proc: subprocess.Popen, out: Path, timeout: float = 150) -> tuple[list[dict], list[dict], str]:
    """`finish` for a run that must exit 0: its events, its decisions and its output."""
    code, output = finish(proc, timeout=timeout)
    assert code == 0, output[-4000:]
    return events.read(out / "job"), decisions(out / "job"), output


def finish(proc: subprocess.Popen, timeout: float = 150) -> tuple[int, str]:
    """`hpcft run`'s exit code and output; the test fails if it runs past `timeout`."""
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"hpcft run did not finish within {timeout} s:\n{output[-4000:]}")
    return proc.returncode, output


def assert_same_ranks(out: Path, ref: Path, ranks: int) -> None:
    """Every rank's final parameters and optimizer state (final.<rank>.pt, TP jobs) equal the reference run's."""
    for rank in range(ranks):
        got = torch.load(out / f"final.{rank}.pt", weights_only=True)
        want = torch.load(ref / f"final.{rank}.pt", weights_only=True)
        assert got["seen"] == want["seen"], rank
        for part in ("params", "optim"):
            assert got[part].keys() == want[part].keys(), (rank, part)
            differ = [k for k, t in want[part].items() if not torch.equal(got[part][k], t)]
            assert not differ, f"rank {rank}: {part} {differ} differ from the uninterrupted run"


def start_spared(sandbox, out: Path, *args: str, **kw) -> subprocess.Popen:
    """`start` on the whole 6-node sandbox: 4 active nodes n1..n4, spares n5 and n6."""
    return start(sandbox, out, 6, "--spares", "2", *args, **kw)


def submit(sandbox, out: Path, *options: str, **env: str) -> str:
    """`hpcft submit OPTIONS -- python train_job.py` into the sandbox (the job's environment: `env`); the job id."""
    argv = [sys.executable, "-m", "hpcft.cli", "submit", "-t", "5", "--module", "", "--job-dir", str(out / "job"),
            "--poll-interval", "0.5", "--requeue-margin", "30", "-o", str(out / "job.out"), *options,
            "--", sys.executable, str(JOB)]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OUT": str(out),
           "SLURM_CONF": sandbox.runner().env["SLURM_CONF"], **env}
    job = subprocess.run(sandbox.client_prefix() + argv, env=env, capture_output=True, text=True, timeout=60)
    assert job.returncode == 0, job.stderr
    return job.stdout.strip()


def ended(runner, job: str) -> bool:
    return job_state(runner, job) in ("COMPLETED", "FAILED", "CANCELLED", "GONE")


def job_state(runner, job: str) -> str:
    """Slurm's state of `job` (PENDING, RUNNING, COMPLETED...), GONE once slurmctld forgot it."""
    out = runner.run(["scontrol", "show", "job", "-o", job], check=False).stdout
    return fields(out).get("JobState", "GONE")
