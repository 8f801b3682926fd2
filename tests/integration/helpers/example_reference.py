"""Fault-free reference runs of the examples on this machine, without Slurm: for each NAME, RANKS ranks of
examples/NAME.py told their place as torchrun tells them (LOCAL_WORLD_SIZE = the ranks per node, tp.py's tensor
parallel size), so their groups, mesh and batches are the sandbox run's. The ranks are forked from this process once
it has imported torch (and transformers for llama): one interpreter's start-up for every rank of every example.

  python example_reference.py OUT RANKS PER_NODE NAME[,NAME…] -- ARGS…   → OUT/NAME/final.pt, OUT/NAME/rank-R.log
Exit 0 when every rank of every example exited 0.
"""
import os
import random
import runpy
import signal
import socket
import sys
import traceback
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def _rank(script: Path, args: list[str], env: dict[str, str], log: Path) -> None:
    """In a forked child: become one rank of `script` and exit with its status (never returns)."""
    code = 1
    try:
        os.environ.update(env)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.argv = [str(script), *args]
        runpy.run_path(str(script), run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - a child reports any failure through its log and status
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _port() -> int:
    """A port to rendezvous on, free now, below the ephemeral range: a port the kernel hands out (to the sandbox runs'
    supervisors listening beside this, to their connections) may be taken again before rank 0 binds it."""
    while True:
        port = random.randrange(10000, 20000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue


def _wait_all(pids: list[int]) -> bool:
    """Wait for the ranks; the first that fails takes the others down (they would wait for it in a collective, or
    for rank 0's rendezvous, for minutes). True when every rank exited 0."""
    left = set(pids)
    while left:
        pid, status = os.wait()
        left.discard(pid)
        if os.waitstatus_to_exitcode(status) != 0:
            for other in left:
                os.kill(other, signal.SIGKILL)
            for other in left:
                os.waitpid(other, 0)
            return False
    return True


def run(out: Path, ranks: int, per_node: int, name: str, args: list[str], tries: int = 3) -> bool:
    """Every rank of examples/NAME.py at once, then wait for them; True when all exited 0. A rendezvous port taken
    meanwhile (rank 0 says EADDRINUSE) is tried again on another."""
    where = out / name
    (where / "store").mkdir(parents=True, exist_ok=True)
    port = _port()
    pids = []
    for rank in range(ranks):
        env = {"RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(rank % per_node),
               "LOCAL_WORLD_SIZE": str(per_node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "TORCHELASTIC_RUN_ID": f"reference-{name}-{port}", "HPCFT_STORE_ROOT": str(where / "store")}
        pid = os.fork()
        if pid == 0:
            _rank(EXAMPLES / f"{name}.py", [*args, "--out", str(where)], env, where / f"rank-{rank}.log")
        pids.append(pid)
    ok = _wait_all(pids)
    if not ok and tries > 1 and "EADDRINUSE" in (where / "rank-0.log").read_text(errors="replace"):
        return run(out, ranks, per_node, name, args, tries - 1)
    return ok


def main(argv: list[str]) -> int:
    out, ranks, per_node, names = Path(argv[0]), int(argv[1]), int(argv[2]), argv[3].split(",")
    args = argv[argv.index("--") + 1:]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(EXAMPLES))
    import torch.distributed.fsdp  # noqa: F401 - what the ranks import, once, before they are forked
    import torch.distributed.tensor.parallel  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    import common  # noqa: F401
    import hpcft.checkpointer  # noqa: F401
    if "llama" in names:
        import transformers.models.llama.modeling_llama  # noqa: F401
    failed = [name for name in names if not run(out, ranks, per_node, name, args)]
    print(f"failed: {','.join(failed)}" if failed else "ok", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
