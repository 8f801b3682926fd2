"""Start N real processes of a scenario script as one gloo job (the HPCFT_* variables hpcft run exports).

Each rank is its own process, forked from a fork server that has imported torch and hpcft once (preload.py), then
given its environment, its stdout/stderr file and the scenario as __main__: ranks are separate processes as under
srun, without every one of them importing torch again (≈ 5 s of CPU a rank on a 2-core machine)."""
import multiprocessing
import os
import runpy
import socket
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

SCENARIOS = Path(__file__).with_name("scenarios.py")
_forkserver = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Result:
    rank: int
    returncode: int
    output: str


def _context():
    """The fork-server context, with preload.py imported in the server (started on first use, once per process)."""
    global _forkserver
    if _forkserver is None:
        _forkserver = multiprocessing.get_context("forkserver")
        _forkserver.set_forkserver_preload(["multiproc.preload"])
    return _forkserver


def _rank(script: str, argv: list[str], env: dict[str, str], log: str) -> None:
    """In the forked rank: its environment, output file and `SCRIPT ARGV` as __main__ (its sys.exit status is the
    process's exit status; a rank that SIGKILLs itself dies of it)."""
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


def run(world: int, scenario: str, *args: str, root: Path, out: Path, job_id: str = "t",
        timeout: float = 180, extra_env: dict[str, str] | None = None, script: Path = SCENARIOS) -> list[Result]:
    """Run `<script> <scenario> --out <out> args...` (default scenarios.py) on `world` ranks; wait for all; return
    each rank's exit status and output (a rank killed by a signal has a negative status)."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    ctx = _context()
    procs = []
    with tempfile.TemporaryDirectory(prefix="hpcft-launch-") as logs:
        for rank in range(world):
            env = {**os.environ, "HPCFT_RANK": str(rank), "HPCFT_WORLD_SIZE": str(world),
                   "HPCFT_LOCAL_RANK": str(rank), "HPCFT_LOCAL_WORLD_SIZE": str(world), "HPCFT_JOB_ID": job_id,
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "HPCFT_STORE_ROOT": str(root),
                   "HPCFT_EVENT_DIR": str(out), "OMP_NUM_THREADS": "1", **(extra_env or {})}
            log = str(Path(logs) / f"rank{rank}.log")
            p = ctx.Process(target=_rank, args=(str(script), [scenario, "--out", str(out), *args], env, log))
            p.start()
            procs.append((p, log))
        results = []
        try:
            for rank, (p, log) in enumerate(procs):
                p.join(timeout)
                if p.exitcode is None:
                    raise TimeoutError(f"rank {rank} of {scenario} still running after {timeout} s:\n"
                                       + Path(log).read_text(errors="replace")[-3000:])
                results.append(Result(rank, p.exitcode, Path(log).read_text(errors="replace")))
        finally:
            for p, _ in procs:
                if p.exitcode is None:
                    p.kill()
                    p.join()
    return results


def check(results: list[Result], expect: int = 0) -> None:
    """Raise with every rank's output unless all exited with `expect`."""
    bad = [r for r in results if r.returncode != expect]
    if bad:
        raise AssertionError("\n".join(f"--- rank {r.rank} exit {r.returncode}\n{r.output[-3000:]}" for r in bad))
