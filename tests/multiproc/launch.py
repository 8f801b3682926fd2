"""Start N real processes of a scenario script as one gloo job (the HPCFT_* variables hpcft run exports)."""
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

SCENARIOS = Path(__file__).with_name("scenarios.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Result:
    rank: int
    returncode: int
    output: str


def run(world: int, scenario: str, *args: str, root: Path, out: Path, job_id: str = "t",
        timeout: float = 180, extra_env: dict[str, str] | None = None, script: Path = SCENARIOS) -> list[Result]:
    """Run `<script> <scenario> --out <out> args...` (default scenarios.py) on `world` ranks; wait for all; return
    each rank's exit status and output (a rank killed by a signal has a negative status)."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "HPCFT_RANK": str(rank), "HPCFT_WORLD_SIZE": str(world), "HPCFT_LOCAL_RANK": str(rank),
               "HPCFT_LOCAL_WORLD_SIZE": str(world), "HPCFT_JOB_ID": job_id, "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "HPCFT_STORE_ROOT": str(root), "HPCFT_EVENT_DIR": str(out),
               "OMP_NUM_THREADS": "1", **(extra_env or {})}
        procs.append(subprocess.Popen([sys.executable, str(script), scenario, "--out", str(out), *args],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results = []
    try:
        for rank, p in enumerate(procs):
            text, _ = p.communicate(timeout=timeout)
            results.append(Result(rank, p.returncode, text))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def check(results: list[Result], expect: int = 0) -> None:
    """Raise with every rank's output unless all exited with `expect`."""
    bad = [r for r in results if r.returncode != expect]
    if bad:
        raise AssertionError("\n".join(f"--- rank {r.rank} exit {r.returncode}\n{r.output[-3000:]}" for r in bad))
