"""How each fault kind of the chaos run is made in the sandbox (mechanism only: when and which is schedule.py's and
run.py's). Targets are read from what the run itself writes: the newest launch's slots (events), each rank's pid (the
job's timeline), each agent's pid (its status). A fault with no target present raises NoTarget."""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcft import events
from hpcft.agent import status as agent_status
from hpcft.agent.protection import flush
from hpcft.agent.protection.bundle import complete_steps
from hpcft.bench import timeline
from hpcft.durable import catalog
from hpcft.errors import HpcftError
from hpcft.launch.node import succession
from hpcft.launch.node import progress
from hpcft.launch.config.resolve import default_durable_dir
from hpcft.sandbox import procs
from hpcft.slurm import state as slurmstate
from hpcft.store import job_dir as store_job_dir

STRAGGLE_S = 8.0  # how long a straggler stays slow (half speed: stopped 0.1 s of every 0.2 s), a store full


class NoTarget(HpcftError):
    """Nothing of the kind a fault needs is running now (between launches): the fault waits for the next step."""


@dataclass
class Scene:
    """The run being faulted: the sandbox, the job's output directory (OUT) and job directory, its Slurm job id."""
    sb: Any
    out: Path
    job_id: str
    crashed: dict[str, float] = field(default_factory=dict)  # node → when it went down (repairs: run.py)
    lock: threading.Lock = field(default_factory=threading.Lock)
    tail: timeline.Tail = field(init=False)

    def __post_init__(self) -> None:
        self.tail = timeline.Tail(self.out)

    @property
    def job_dir(self) -> Path:
        return self.out / "job"

    def slots(self) -> list[str]:
        """The nodes of the newest launch, slot by slot."""
        launch = next((e for e in reversed(events.read(self.job_dir)) if e["event"] in ("launch", "start")), None)
        if launch is None:
            raise NoTarget("no launch yet")
        return launch["slots"].split(",")

    def ranks(self) -> dict[int, int]:
        """rank → pid of the newest launch's trainers (by their first record)."""
        recs = [r for r in self.tail.records() if "rank" in r and r["what"] in ("init", "step")]
        if not recs:
            raise NoTarget("no trainer has started")
        newest = recs[-1]["run"]
        return {r["rank"]: r["pid"] for r in recs if r["run"] == newest}

    def agents(self) -> dict[int, dict]:
        """slot → the newest launch's agent report (pid, phase, flushing …)."""
        reports = agent_status.read(self.job_dir / "agents")
        if not reports:
            raise NoTarget("no node agent is running")
        tag = max(reports.values(), key=lambda r: r.get("time", 0))["tag"]
        return {s: r for s, r in agent_status.read(self.job_dir / "agents", tag).items() if _alive(r["pid"])}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def _choose(items: list, pick: float) -> Any:
    if not items:
        raise NoTarget("no target")
    return sorted(items)[min(int(pick * len(items)), len(items) - 1)]


def _rank(scene: Scene, pick: float) -> tuple[int, int]:
    """(rank, pid) of the trainer `pick` chooses among the newest launch's."""
    ranks = scene.ranks()
    rank = _choose(list(ranks), pick)
    return rank, ranks[rank]


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        raise NoTarget(f"pid {pid} has ended") from None


def rank_kill(scene: Scene, pick: float) -> str:
    rank, pid = _rank(scene, pick)
    _signal(pid, signal.SIGKILL)
    return f"rank {rank}"


def exception(scene: Scene, pick: float) -> str:
    """SIGUSR2, which the job (CHAOS=1) turns into a RuntimeError raised where its main thread is."""
    rank, pid = _rank(scene, pick)
    _signal(pid, signal.SIGUSR2)
    return f"rank {rank}"


def hang(scene: Scene, pick: float) -> str:
    rank, pid = _rank(scene, pick)
    _signal(pid, signal.SIGSTOP)  # the supervisor's hang timeout kills it (SIGKILL ends a stopped one)
    return f"rank {rank}"


def straggler(scene: Scene, pick: float) -> str:
    """A node at half speed for STRAGGLE_S seconds: its ranks stopped 0.1 s of every 0.2 s (a thread does it)."""
    slots = scene.slots()
    slot = _choose(list(range(len(slots))), pick)
    pid = scene.ranks().get(slot)
    if pid is None:
        raise NoTarget(f"slot {slot} has no trainer")

    def slow() -> None:
        end = time.monotonic() + STRAGGLE_S
        while time.monotonic() < end:
            for sig in (signal.SIGSTOP, signal.SIGCONT):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    return
                time.sleep(0.1)

    threading.Thread(target=slow, name="hpcft-chaos-straggler", daemon=True).start()
    return f"{slots[slot]} (rank {slot}) for {STRAGGLE_S:g} s"


def agent_kill(scene: Scene, pick: float) -> str:
    agents = scene.agents()
    slot = _choose(list(agents), pick)
    _signal(agents[slot]["pid"], signal.SIGKILL)
    return f"agent of slot {slot}"


def kill_in_snapshot(scene: Scene, pick: float) -> str:
    """SIGKILL a rank as soon as it records a new step: its snapshot of that step is being copied then."""
    rank, pid = _rank(scene, pick)
    seen = len(scene.tail.records())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        recs = scene.tail.records()[seen:]
        if any(r["what"] == "step" and r.get("rank") == rank and r["pid"] == pid for r in recs):
            _signal(pid, signal.SIGKILL)
            return f"rank {rank}"
        time.sleep(0.005)
    raise NoTarget(f"rank {rank} completed no step within 10 s")


def kill_in_protect(scene: Scene, pick: float) -> str:
    """SIGKILL an agent whose node holds a snapshot newer than its protected one: it is in a round."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        agents = scene.agents()
        newest = max((s for s, _ in progress.read(scene.job_dir).values()), default=-1)
        busy = [s for s, r in agents.items() if r.get("protected") is not None and r["protected"] < newest]
        if busy:
            slot = _choose(busy, pick)
            _signal(agents[slot]["pid"], signal.SIGKILL)
            return f"agent of slot {slot} (protected {agents[slot]['protected']}, trainers at {newest})"
        time.sleep(0.02)
    raise NoTarget("no agent was behind the trainers within 10 s")


def kill_in_flush(scene: Scene, pick: float) -> str:
    """Ask the agents for a flush; once its temporary directory appears in the durable tier, stop the agents and,
    the flush still uncommitted, SIGKILL one of them (the rest go on). Their reports reach chaos through the
    supervisor's log up to a second old, and a flush of the bench's model takes tens of milliseconds."""
    agents = scene.agents()
    if not agents:  # the newest launch's agents are gone: a relaunch is under way
        raise NoTarget("no agent of the newest launch is running")
    pids = {s: r["pid"] for s, r in agents.items()}
    root = default_durable_dir(scene.job_dir)  # the chaos job's (no --persist-dir)
    before = catalog.temporaries(root)
    flush.request(scene.job_dir / "agents", next(iter(agents.values()))["tag"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if catalog.temporaries(root) - before:
            with _stopped(pids.values()):  # the commit cannot happen between the look below and the kill
                if catalog.temporaries(root) - before:
                    slot = _choose(list(pids), pick)
                    _signal(pids[slot], signal.SIGKILL)
                    return f"agent of slot {slot} mid-flush"
        time.sleep(0.002)
    raise NoTarget("no flush started within 10 s")


@contextlib.contextmanager
def _stopped(pids: Iterable[int]) -> Iterator[None]:
    """`pids` stopped (SIGSTOP) for the block, continued after; one that has ended is passed over."""
    pids = list(pids)
    _signal_each(pids, signal.SIGSTOP)
    try:
        yield
    finally:
        _signal_each(pids, signal.SIGCONT)


def _signal_each(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def corrupt_chunk(scene: Scene, pick: float) -> str:
    """Flip bytes in the newest complete snapshot one rank holds in its node's memory, then SIGKILL that rank, so that
    the restore reads the corrupt copy (its checksum must send it to a peer's, the parity or the durable tier)."""
    rank, pid = _rank(scene, pick)
    held = complete_steps(store_job_dir(procs.shm(pid), scene.job_id))
    if not held:
        raise NoTarget(f"rank {rank}'s node holds no complete snapshot")
    chunk = held[max(held)].get(rank)
    if chunk is None:
        raise NoTarget(f"rank {rank} holds no part of step {max(held)}")
    with open(chunk.data_path, "r+b") as fh:
        fh.seek(64)
        data = fh.read(16)
        fh.seek(64)
        fh.write(bytes(b ^ 0xFF for b in data))
    _signal(pid, signal.SIGKILL)
    return f"rank {rank}, step {max(held)}"


def enospc(scene: Scene, pick: float) -> str:
    """One node's /dev/shm filled to its last MiB for STRAGGLE_S seconds (another job's files, as its ranks see it):
    their snapshots find no space, are skipped and said; training goes on. The filler is removed through a handle on
    the directory, so it goes even if the node's ranks end meanwhile."""
    rank, pid = _rank(scene, pick)
    shm = procs.shm(pid)
    try:
        fd = os.open(shm, os.O_RDONLY | os.O_DIRECTORY)
        free = os.statvfs(fd).f_bavail * os.statvfs(fd).f_frsize
        filler = os.open("hpcft-chaos-filler", os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=fd)
    except OSError as exc:
        raise NoTarget(f"rank {rank}'s /dev/shm: {exc}") from None
    try:
        os.posix_fallocate(filler, 0, max(0, free - (1 << 20)))
    except OSError:
        pass  # as full as it gets
    finally:
        os.close(filler)

    def free_it() -> None:
        time.sleep(STRAGGLE_S)
        with contextlib.suppress(OSError):
            os.unlink("hpcft-chaos-filler", dir_fd=fd)
        os.close(fd)

    threading.Thread(target=free_it, name="hpcft-chaos-enospc", daemon=True).start()
    return f"rank {rank}'s node, {free >> 20} MiB filled for {STRAGGLE_S:g} s"


def walltime(scene: Scene, pick: float) -> str:
    """Slurm's walltime warning now: USR1 to the batch script (hpcft run), which protects, flushes and requeues; to a
    successor (which Slurm does not signal: it watches the end time itself) straight, as nothing else reaches it."""
    record = succession.read(scene.job_dir)
    if record is not None and record.generation:
        os.kill(record.pid, signal.SIGUSR1)  # the sandbox's nodes share this host's processes
        return f"job {scene.job_id} (supervisor generation {record.generation})"
    scene.sb.runner().run(["scancel", "--batch", "--signal=USR1", scene.job_id])
    return f"job {scene.job_id}"


def _batch_host(scene: Scene) -> str:
    """The node the supervisor runs on: the batch host, or the successor's once a janitor took over."""
    record = succession.read(scene.job_dir)
    return record.host if record is not None else slurmstate.job_info(scene.sb.runner(), scene.job_id).batch_host


def node_crash(scene: Scene, pick: float, count: int = 1, nodes: list[str] | None = None) -> str:
    """`count` active nodes other than the batch host frozen at once (heartbeats and Slurm go silent), powered off
    once the supervisor has decided on it (or the janitors, for the batch host) or after 30 s; run.py powers them on
    again after the repair time."""
    if nodes is None:
        host = _batch_host(scene)
        slots = [n for n in scene.slots() if n != host]
        if len(slots) < count:
            raise NoTarget(f"fewer than {count} active nodes besides the batch host {host}")
        first = min(int(pick * len(slots)), len(slots) - 1)
        nodes = [slots[(first + i) % len(slots)] for i in range(count)]
    decided = len([e for e in events.read(scene.job_dir) if e["event"] in ("decision", "batch_host_lost")])
    for node in nodes:
        scene.sb.freeze_node(node)

    def power_off() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if len([e for e in events.read(scene.job_dir) if e["event"] in ("decision", "batch_host_lost")]) > decided:
                break
            time.sleep(0.2)
        for node in nodes:
            scene.sb.crash_node(node)
            with scene.lock:
                scene.crashed[node] = time.monotonic()

    threading.Thread(target=power_off, name="hpcft-chaos-power-off", daemon=True).start()
    return ",".join(nodes)


def batch_host(scene: Scene, pick: float) -> str:
    """The node running hpcft run (the batch script's, or a successor's), which also trains: a janitor takes over."""
    return node_crash(scene, pick, nodes=[_batch_host(scene)])


def two_nodes(scene: Scene, pick: float) -> str:
    if len(scene.slots()) < 3:
        raise NoTarget("fewer than 3 active nodes: two lost would leave no set")
    return node_crash(scene, pick, count=2)


INJECT = {"rank_kill": rank_kill, "node_crash": node_crash, "exception": exception, "hang": hang,
          "straggler": straggler, "agent_kill": agent_kill, "kill_in_snapshot": kill_in_snapshot,
          "kill_in_protect": kill_in_protect, "kill_in_flush": kill_in_flush, "two_nodes": two_nodes,
          "corrupt_chunk": corrupt_chunk, "batch_host": batch_host, "enospc": enospc, "walltime": walltime}
