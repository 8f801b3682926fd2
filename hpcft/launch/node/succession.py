"""Who supervises the job: `hpcft run` says where it lives (supervisor.json, once per start) and answers a UDP
beacon; a few janitors ping it over the network (nothing per node on the shared file system). When it falls silent
and Slurm says its node is lost, the first janitor to claim the next generation becomes the supervisor in the same
allocation (`take_over`: `hpcft run` again, with the saved arguments and environment): a chain, not one backup."""
from __future__ import annotations

import json
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hpcft.agent.transport.heartbeat import LOSS_TIMEOUT_S
from hpcft.agent.transport.rendezvous import addresses

ENV_SUCCESSION = "HPCFT_SUCCESSION"  # in a successor's environment: "GENERATION:LOST_NODE"
WATCHERS = 3  # janitors that ping the supervisor, on the nodes after its own in the job's order
PING_TIMEOUT_S = 1.0


def record_path(job_dir: str | os.PathLike) -> Path:
    return Path(job_dir) / "supervisor.json"


@dataclass
class Record:
    """What a successor needs: where the supervisor is (`host`, `beacon`), and how to start one like it."""
    generation: int
    host: str
    beacon: str  # "addr[,addr...]:port", UDP
    token: str
    argv: list[str]
    cwd: str
    env: dict[str, str]
    takeover: bool = True  # --takeover: whether a janitor may become the supervisor (else it requeues)
    probe_timeout: float = 15.0  # --probe-timeout: how long the supervisor's node may take to answer a probe
    loss_timeout: float = LOSS_TIMEOUT_S  # --loss-timeout: the supervisor unanswering this long is a suspect
    pid: int = 0
    started: float = field(default_factory=time.time)

    def write(self, job_dir: str | os.PathLike) -> None:
        """Atomically, readable by the job's owner only (it holds the environment)."""
        path = record_path(job_dir)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(self), f)
        os.replace(tmp, path)


def read(job_dir: str | os.PathLike) -> Record | None:
    """The newest supervisor's record, or None when there is none (not started, or an older hpcft)."""
    try:
        return Record(**json.loads(record_path(job_dir).read_text()))
    except (OSError, ValueError, TypeError):
        return None


class Beacon:
    """The supervisor's answer to the janitors' pings (a daemon thread): alive while `hpcft run` is."""

    def __init__(self, token: str, generation: int, iface: str | None = None):
        self.token, self.generation = token, generation
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("0.0.0.0", 0))
        self.address = f"{','.join(addresses(iface))}:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True, name="hpcft-beacon").start()

    def _serve(self) -> None:
        while True:
            try:
                data, peer = self.sock.recvfrom(256)
            except OSError:
                return  # closed
            if data == f"hpcft? {self.token}".encode():
                try:
                    self.sock.sendto(f"hpcft! {self.generation}".encode(), peer)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def ping(beacon: str, token: str, timeout: float = PING_TIMEOUT_S) -> int | None:
    """The generation of the supervisor answering at `beacon`, or None if none did within `timeout`."""
    hosts, _, port = beacon.rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout / max(1, len(hosts.split(","))))
        for host in hosts.split(","):
            try:
                sock.sendto(f"hpcft? {token}".encode(), (host, int(port)))
                data = sock.recv(256).decode()
            except (OSError, ValueError):
                continue
            if data.startswith("hpcft! "):
                return int(data.split()[1])
    return None


def watchers(nodes: Sequence[str], host: str, k: int = WATCHERS) -> list[str]:
    """The nodes whose janitors ping the supervisor on `host`: the `k` after it in `nodes`' order (wrapping round),
    which are also, in that order, its successors; `host` itself never."""
    others = [n for n in nodes if n != host]
    if host in nodes:
        at = list(nodes).index(host)
        others = [n for n in [*nodes[at + 1:], *nodes[:at]] if n != host]
    return others[:k]


def claim(job_dir: str | os.PathLike, run: str, generation: int) -> bool:
    """Take generation `generation` of Slurm run `run`'s supervision: True for the one janitor that claims first."""
    try:
        os.close(os.open(Path(job_dir) / f"supervisor-claim-{run}-{generation}",
                         os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        return True
    except FileExistsError:
        return False


def successor_env(record: Record, environ: Mapping[str, str], generation: int) -> dict[str, str]:
    """The successor's environment: the supervisor's own (the batch script's, not a janitor step's), with this
    process's way to import hpcft and node name, the generation it takes over as and the node it replaces."""
    env = dict(record.env)
    for key in ("PYTHONPATH", "SLURMD_NODENAME"):
        if environ.get(key):
            env[key] = environ[key]
    env[ENV_SUCCESSION] = f"{generation}:{record.host}"
    return env


def take_over(record: Record, generation: int, log: Path) -> None:
    """Become `hpcft run` (this process, so that it stays a task of its step): the same arguments in the same
    directory, output appended to `log`. Returns only if the exec failed (the caller falls back to a requeue)."""
    fd = os.open(log, os.O_CREAT | os.O_APPEND | os.O_WRONLY, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(record.cwd)
    os.execve(sys.executable, [sys.executable, "-m", "hpcft.cli", *record.argv],
              successor_env(record, os.environ, generation))


def succeeds(environ: Mapping[str, str]) -> tuple[int, str]:
    """(this supervisor's generation, the node of the one it replaces): (0, "") for the batch script's `hpcft run`,
    (N, node) for the Nth successor."""
    gen, _, lost = environ.get(ENV_SUCCESSION, "").partition(":")
    return (int(gen), lost) if gen.isdigit() else (0, "")


def start(job_dir: str | os.PathLike, environ: Mapping[str, str], iface: str | None,
          argv: Sequence[str] | None, takeover: bool = True, probe_timeout: float = 15.0,
          loss_timeout: float = LOSS_TIMEOUT_S) -> Beacon:
    """Answer the janitors and say where (supervisor.json): once, at the supervisor's start. `argv`: `hpcft run`'s
    arguments, which a successor runs again (None: no successor can, and a lost supervisor means a requeue)."""
    gen = succeeds(environ)[0]
    beacon = Beacon(secrets.token_hex(16), gen, iface)
    env = {k: v for k, v in environ.items() if k != ENV_SUCCESSION}
    Record(generation=gen, host=environ.get("SLURMD_NODENAME") or socket.gethostname(), beacon=beacon.address,
           token=beacon.token, argv=list(argv or []), cwd=os.getcwd(), env=env, takeover=takeover,
           probe_timeout=probe_timeout, loss_timeout=loss_timeout, pid=os.getpid()).write(job_dir)
    return beacon
