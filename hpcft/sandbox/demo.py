"""`hpcft demo`: the sandbox up, `hpcft doctor` inside a 4-node allocation, and a 4-node srun step."""
import re
import sys
import time
from collections.abc import Callable

from hpcft.errors import SlurmError
from hpcft.sandbox.cluster import ensure_up
from hpcft.sandbox.config import SandboxConfig


def run_demo(config: SandboxConfig, say: Callable[[str], None]) -> int:
    """Run the demo, telling `say` what happens; the exit status is 0 only if every step worked."""
    t0 = time.monotonic()
    sb, started = ensure_up(config)
    say(f"[1/3] sandbox {'started' if started else 'already up'} in {time.monotonic() - t0:.1f} s: "
        f"nodes {', '.join(sb.node_names)} (mode {sb.config.mode}, dir {sb.dir})")
    runner = sb.runner(timeout=120)
    nodes = len(sb.node_names)
    alloc = runner.run(["salloc", f"-N{nodes}", "--no-shell", "--job-name=hpcft-demo"])
    match = re.search(r"Granted job allocation (\d+)", alloc.stderr + alloc.stdout)
    if not match:
        raise SlurmError(f"salloc did not report a job id: {alloc.stderr.strip()}")
    job = match.group(1)
    failures = 0
    try:
        say(f"[2/3] job {job}: `hpcft doctor` on the first node of the allocation")
        doctor = runner.run(["srun", f"--jobid={job}", "-N1", "-n1", sys.executable, "-m", "hpcft.cli", "doctor"], check=False)
        say(_indent(doctor.stdout + doctor.stderr))
        failures += doctor.returncode != 0
        say(f"[3/3] job {job}: `srun -N{nodes} hostname`, one task per node")
        step = runner.run(["srun", f"--jobid={job}", f"-N{nodes}", f"--ntasks-per-node=1", "--label", "hostname"], check=False)
        say(_indent(step.stdout + step.stderr))
        failures += step.returncode != 0
    finally:
        runner.run(["scancel", job], check=False)
    say("demo " + ("done: every step worked" if not failures else f"finished with {failures} failed step(s)")
        + f"; the sandbox stays up (`hpcft sandbox status`, `hpcft sandbox down`)")
    return 1 if failures else 0


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.rstrip().splitlines())
