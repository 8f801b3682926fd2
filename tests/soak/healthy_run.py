"""A soak run, not part of the suite: a healthy run of about 30 minutes with heartbeats on (issue #14: no false loss).
4 active nodes + 1 spare in a sandbox of its own, xor protection, the DP job at about 1 step/s; afterwards it prints
the decisions and every loss-like or error-level event as JSON. `python tests/soak/healthy_run.py [STEPS]`, as root."""
import json
import subprocess
import sys
import time
from pathlib import Path
from hpcft import events
from hpcft.bench import train_job
from hpcft.sandbox import Sandbox, SandboxConfig
from hpcft.sandbox.config import plan

d, out = Path("/tmp/sb-long"), Path("/tmp/long-run")
out.mkdir(parents=True, exist_ok=True)
sb = Sandbox(plan(SandboxConfig(dir=d, nodes=5, mode="netns", prolog=None, epilog=None)))
sb.up(timeout=120)
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 1700
env = {"OUT": str(out), "STEPS": str(steps), "STEP_DELAY": "1.0", "PYTHONUNBUFFERED": "1"}
argv = ["salloc", "-N5", "--no-kill", "-t", "45", sys.executable, "-m", "hpcft.cli", "run", "--spares", "1",
        "--protect", "xor", "--job-dir", str(out / "job"), "--", sys.executable, train_job.__file__]
t0 = time.time()
with open(out / "job.out", "w") as log:
    code = sb.runner().popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, text=True).wait()
recs = events.read(out / "job")
bad = [e for e in recs if e["event"] in ("peer_silent", "peer_closed", "agents_late", "agents_suspect", "agents_failed", "node_bad",
                                          "node_failed", "straggler", "progress_lost", "hang") or e.get("level") == "ERROR"]
print(json.dumps({"exit": code, "wall_s": round(time.time() - t0), "decisions": [e["action"] for e in recs if e["event"] == "decision"],
                  "events": len(recs), "bad": bad[:20]}, indent=1))
sb.down()
