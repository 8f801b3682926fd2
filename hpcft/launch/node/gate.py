"""A relaunch onto a spare starts the trainers' step together with the agents' rebuild: the tasks on the nodes being
rebuilt wait here, before their command, until the supervisor says the agents are ready (a file in the job directory
it creates then); every other task goes on to its process group, which waits for them. Only those nodes' tasks look
at the file, only during that relaunch."""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from hpcft.slurm.nodelist import compress, expand

ENV_FILE, ENV_NODES, ENV_TIMEOUT = "HPCFT_GATE_FILE", "HPCFT_GATE_NODES", "HPCFT_GATE_TIMEOUT"
POLL_S = 0.02


def env(path: Path, nodes: Sequence[str], timeout: float) -> dict[str, str]:
    """What the trainers' step is told: the tasks of `nodes` wait for `path`, at most `timeout` seconds."""
    return {ENV_FILE: str(path), ENV_NODES: compress(list(nodes)), ENV_TIMEOUT: f"{timeout:g}"}


def wait(environ: Mapping[str, str], sleep: Callable[[float], None] = time.sleep,
         clock: Callable[[], float] = time.monotonic) -> str | None:
    """Wait while this task's node is gated and the file is missing; None once it may go on, else why not (the
    timeout passed: the supervisor stops the step by then)."""
    path, nodes = environ.get(ENV_FILE), environ.get(ENV_NODES)
    if not path or not nodes or environ.get("SLURMD_NODENAME") not in expand(nodes):
        return None
    timeout = float(environ.get(ENV_TIMEOUT) or 0)
    deadline = clock() + timeout
    while not os.path.exists(path):
        if clock() >= deadline:
            return f"the agents' rebuild of this node was not ready within {timeout:g} s ({path} never appeared)"
        sleep(POLL_S)
    return None
