"""`hpcft demo`: what hpcft does, end to end, on this machine. A 4-node Slurm sandbox comes up; `hpcft doctor` and a
4-node srun step show the cluster side; then `hpcft run --spares 1 --protect xor` trains a small DP job on 3 nodes,
a node is crashed mid-run, the spare takes its slot, the node agents rebuild its snapshot there from the others'
data and parity, and training resumes from memory. The crashed node is powered back on at the end."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import click

from hpcft import events
from hpcft.agent import status as agent_status
from hpcft.bench import train_job
from hpcft.errors import HpcftError, SlurmError
from hpcft.launch.node import progress
from hpcft.launch.config.sections import LOST_PROGRESS_EXIT as LOST_EXIT  # the default: the demo runs on it
from hpcft.report import summary as report
from hpcft.report.timeline import try_draw
from hpcft.sandbox.cli import dir_option, sandbox_dir
from hpcft.sandbox.cluster import Sandbox, ensure_up
from hpcft.sandbox.config import SandboxConfig

STEPS, DELAY = 30, 0.3
TP = 2  # ranks per node, tensor parallel inside a node as on a GPU node (Frontier runs 8)
BACKEND = "cuda:gloo"  # hpcft.init's backend: on a CPU, groups that refuse CPU tensors, as NCCL/RCCL ones do
LEFT = 10  # steps at least still to train when the node is crashed
NODES = 4  # the training's allocation, whatever the sandbox's size: 3 nodes train, 1 is the spare


def run_demo(config: SandboxConfig, say: Callable[[str], None]) -> int:
    """Run the demo, telling `say` what happens; the exit status is 0 only if every part worked."""
    t0 = time.monotonic()
    sb, started = ensure_up(config)
    say(f"[1/4] sandbox {'started' if started else 'already up'} in {time.monotonic() - t0:.1f} s: "
        f"nodes {', '.join(sb.node_names)} (mode {sb.config.mode}, dir {sb.dir})")
    failures = _cluster_side(sb, say)
    failures += train_through_a_crash(sb, say)
    say("demo " + ("done: every part worked" if not failures else f"finished with {failures} failed part(s)")
        + "; the sandbox stays up (`hpcft sandbox status`, `hpcft sandbox down`)")
    return 1 if failures else 0


def _cluster_side(sb: Sandbox, say: Callable[[str], None]) -> int:
    runner = sb.runner(timeout=120)
    nodes = len(sb.node_names)
    alloc = runner.run(["salloc", f"-N{nodes}", "--no-shell", "--job-name=hpcft-demo"])
    match = re.search(r"Granted job allocation (\d+)", alloc.stderr + alloc.stdout)
    if not match:
        raise SlurmError(f"salloc did not report a job id: {alloc.stderr.strip()}")
    job = match.group(1)
    failures = 0
    try:
        say(f"[2/4] job {job}: `hpcft doctor` on the first node of the allocation")
        doctor = runner.run(["srun", f"--jobid={job}", "-N1", "-n1", sys.executable, "-m", "hpcft.cli", "doctor"],
                            check=False)
        say(_indent(doctor.stdout + doctor.stderr))
        failures += doctor.returncode != 0
        say(f"[3/4] job {job}: `srun -N{nodes} hostname`, one task per node")
        step = runner.run(["srun", f"--jobid={job}", f"-N{nodes}", "--ntasks-per-node=1", "--label", "hostname"],
                          check=False)
        say(_indent(step.stdout + step.stderr))
        failures += step.returncode != 0
    finally:
        runner.run(["scancel", job], check=False)
    return failures


def train_through_a_crash(sb: Sandbox, say: Callable[[str], None]) -> int:
    """`hpcft run` with a spare and XOR protection on `NODES` nodes of the sandbox (fewer if it has fewer); one node
    crashed once the agents have protected a step. Its output goes to a new directory under `<sandbox>/demo/`."""
    nodes = min(NODES, len(sb.node_names))
    out = sb.dir / "demo" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    job_dir = out / "job"
    active = nodes - 1
    # a confined sandbox (`--confine`) gives each rank its own (fake) GPU, as a Frontier node does
    gpus = ([f"--gres=gpu:{TP}"], ["--srun-args=--gpus-per-task=1"]) if sb.config.confine else ([], [])
    argv = ["salloc", f"-N{nodes}", f"--ntasks-per-node={TP}", *gpus[0], "--no-kill", "-t", "10",
            "--job-name=hpcft-demo-train", sys.executable, "-m", "hpcft.cli", "run", *gpus[1], "--spares", "1",
            "--tasks-per-node", str(TP),
            "--protect", "xor", "--group", str(active), "--job-dir",
            str(job_dir), "--poll-interval", "0.5", "--kill-grace", "1", "--probe-timeout", "5", "--",
            sys.executable, train_job.__file__]
    say(f"[4/4] `hpcft run --spares 1 --tasks-per-node {TP} --protect xor --group {active} -- python train_job.py` "
        f"in a {nodes}-node allocation: {active} nodes train, {TP} ranks each (tensor parallel inside a node, data "
        f"parallel across nodes, process groups that refuse CPU tensors as NCCL/RCCL ones do; {STEPS} steps, a "
        f"snapshot in /dev/shm every step), 1 is a spare; output in {out}")
    env = {"OUT": str(out), "STEPS": str(STEPS), "STEP_DELAY": str(DELAY), "PYTHONUNBUFFERED": "1", "TP": str(TP),
           "BACKEND": BACKEND}
    with open(out / "run.log", "wb") as log:
        proc = sb.runner().popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    crashed = None
    try:
        protected = _wait_protected(job_dir, active, proc)
        first = next(e for e in events.read(job_dir) if e["event"] == "start")
        crashed = first["slots"].split(",")[1]
        reached = max((step for step, _ in progress.read(job_dir).values()), default=0)
        if reached > STEPS - LEFT:  # a crash now may land after the training's end: it would show nothing
            raise HpcftError(f"the agents protected their first step only when the trainers were at step {reached} of "
                             f"{STEPS}: too late to crash a node while they train (is this machine loaded?)")
        say(f"    the agents have protected step {protected} on every node (the trainers are at step {reached} of "
            f"{STEPS}); crashing {crashed} (its slurmd, its {TP} ranks and its /dev/shm)")
        sb.crash_node(crashed)
        code = proc.wait(timeout=300)
    except (HpcftError, subprocess.TimeoutExpired) as exc:
        proc.kill()
        proc.wait()
        say(f"    failed: {exc}; see {out / 'run.log'}")
        return 1
    finally:
        if crashed:
            sb.restart_node(crashed, timeout=60)
    return _report(job_dir, out, code, crashed, say)


def _wait_protected(job_dir: Path, slots: int, proc: subprocess.Popen, timeout: float = 180) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise HpcftError(f"hpcft run ended (exit status {proc.returncode}) before the agents protected a step")
        done = [s.get("protected") for s in agent_status.read(job_dir / "agents", "0").values()]
        if len(done) == slots and all(d is not None and d > 0 for d in done):
            return min(done)
        time.sleep(0.2)
    raise HpcftError(f"the agents protected no step within {timeout:g} s")


def _report(job_dir: Path, out: Path, code: int, crashed: str, say: Callable[[str], None]) -> int:
    log = events.read(job_dir)
    for e in log:
        if e["event"] == "decision":
            say(f"    decision: {e['action']} — {e['reason']}")
        elif e["event"] == "agents_ready" and e.get("rebuild"):
            say(f"    agents: rebuilt step {e['step']} onto {e['rebuilt'] or '(nothing missing)'}, then released the "
                "trainers")
        elif e["event"] in ("agents_no_checkpoint", "progress_lost"):  # what went wrong, said where it shows
            say(f"    {e['event']}: " + " ".join(f"{k}={e[k]}" for k in ("reason", "steps_lost") if k in e))
    timeline = [json.loads(line) for line in (out / "timeline.jsonl").read_text().splitlines()]
    resumed = sorted({r["step"] for r in timeline if r["what"] == "restored" and r["run"] != "0.0"})
    summary = next((e for e in reversed(log) if e["event"] == "summary"), {})
    lost = f" ({summary.get('steps_lost')} step(s) after the protected one trained again)" if code == LOST_EXIT else ""
    say(f"    every rank resumed from step {', '.join(map(str, resumed)) or '?'} (from memory, {crashed}'s ranks' "
        f"snapshots rebuilt on the spare) and the job finished: exit status {code}{lost}, parameters in "
        f"{out / 'final.pt'}; {crashed} is back in the sandbox")
    run = report.read(job_dir)
    for incident in run.incidents:  # `hpcft report` on the job directory: what the crash cost
        say(f"    report: {incident.line()}")
    say(f"    {try_draw(job_dir, summary=run)[1]}")
    return 0 if code in (0, LOST_EXIT) and resumed and min(resumed) > 0 else 1


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.rstrip().splitlines())


@click.command()
@dir_option
def demo(directory: Path | None) -> None:
    """A 4-node Slurm sandbox, `hpcft doctor`, an srun step, then training that survives a node crash."""
    raise click.exceptions.Exit(run_demo(SandboxConfig(dir=sandbox_dir(directory), nodes=4), click.echo))
