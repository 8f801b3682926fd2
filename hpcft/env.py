"""What a task knows about its job, from one place: hpcft's launcher, torchrun, Slurm, or a plain local run.
Precedence: HPCFT_* (exported by `hpcft run`, which owns the slot layout) > torchrun's variables > SLURM_* of an srun
step > a single local process. Every other module asks `job_env()`."""
import os
import re
import socket
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from hpcft.errors import ConfigError
from hpcft.slurm.nodelist import expand

REPORTS = "HPCFT_REPORTS"  # host[,host…]:port of the supervisor's report service (hpcft/agent/transport/uplink.py)
AGENTS_REPORT = "HPCFT_AGENTS_REPORT"  # 1: the node agents report their node's progress; 0: the task wrapper does

PORT_BASE, PORT_SPAN = 20000, 20000


@dataclass(frozen=True)
class JobEnv:
    """The job as one task sees it; `source` says where the facts came from."""

    source: str
    job_id: str
    node_name: str
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    restart_count: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    nodelist: list[str] = field(default_factory=list)


DEFAULT_JOB_ID = "local"  # a run that names no job: every such run on a node shares one store


def port_for_job(job_id: str) -> int:
    """A rendezvous port derived from the job id, so every task of a job agrees without talking."""
    key = int(job_id) if job_id.isdigit() else zlib.crc32(job_id.encode())
    return PORT_BASE + key % PORT_SPAN


def tasks_per_node(spec: str) -> list[int]:
    """Expand Slurm's `SLURM_TASKS_PER_NODE` form `2(x3),1` into [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in filter(None, spec.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise ConfigError(f"cannot parse tasks per node {spec!r} (expected e.g. '2(x3),1')")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None or value == "":
        if default is None:
            raise ConfigError(f"environment variable {name} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer") from None


def _from_hpcft(env: Mapping[str, str]) -> JobEnv:
    job_id = env.get("HPCFT_JOB_ID", DEFAULT_JOB_ID)
    nodes = expand(env.get("HPCFT_NODELIST", ""))
    return JobEnv(
        source="hpcft",
        job_id=job_id,
        node_name=env.get("HPCFT_NODE_NAME") or env.get("SLURMD_NODENAME") or socket.gethostname(),
        rank=_int(env, "HPCFT_RANK"),
        local_rank=_int(env, "HPCFT_LOCAL_RANK", 0),
        world_size=_int(env, "HPCFT_WORLD_SIZE"),
        local_world_size=_int(env, "HPCFT_LOCAL_WORLD_SIZE", 1),
        node_rank=_int(env, "HPCFT_NODE_RANK", 0),
        restart_count=_int(env, "HPCFT_RESTART_COUNT", 0),
        master_addr=env.get("MASTER_ADDR") or (nodes[0] if nodes else "127.0.0.1"),
        master_port=_int(env, "MASTER_PORT", port_for_job(job_id)),
        nodelist=nodes,
    )


def _from_torchrun(env: Mapping[str, str]) -> JobEnv:
    job_id = env.get("SLURM_JOB_ID") or env.get("TORCHELASTIC_RUN_ID") or DEFAULT_JOB_ID
    return JobEnv(
        source="torchrun",
        job_id=job_id,
        node_name=env.get("SLURMD_NODENAME") or socket.gethostname(),
        rank=_int(env, "RANK"),
        local_rank=_int(env, "LOCAL_RANK", 0),
        world_size=_int(env, "WORLD_SIZE"),
        local_world_size=_int(env, "LOCAL_WORLD_SIZE", 1),
        node_rank=_int(env, "GROUP_RANK", 0),
        restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0) + _int(env, "SLURM_RESTART_COUNT", 0),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int(env, "MASTER_PORT", 29500),
        nodelist=expand(env.get("SLURM_JOB_NODELIST", "")),
    )


def _from_slurm(env: Mapping[str, str]) -> JobEnv:
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or "0"
    nodes = expand(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", ""))
    node_rank = _int(env, "SLURM_NODEID", 0)
    per_node = tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "1")
    local_world = per_node[node_rank] if node_rank < len(per_node) else per_node[-1]
    return JobEnv(
        source="slurm",
        job_id=job_id,
        node_name=env.get("SLURMD_NODENAME") or socket.gethostname(),
        rank=_int(env, "SLURM_PROCID"),
        local_rank=_int(env, "SLURM_LOCALID", 0),
        world_size=_int(env, "SLURM_STEP_NUM_TASKS", _int(env, "SLURM_NTASKS", 1)),
        local_world_size=local_world,
        node_rank=node_rank,
        restart_count=_int(env, "SLURM_RESTART_COUNT", 0),
        master_addr=env.get("MASTER_ADDR") or (nodes[0] if nodes else "127.0.0.1"),
        master_port=_int(env, "MASTER_PORT", port_for_job(job_id)),
        nodelist=nodes,
    )


def _local(env: Mapping[str, str]) -> JobEnv:
    host = socket.gethostname()
    return JobEnv(
        source="local",
        job_id=env.get("HPCFT_JOB_ID", DEFAULT_JOB_ID),
        node_name=host,
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int(env, "MASTER_PORT", 29500),
        nodelist=[host],
    )


def job_env(environ: Mapping[str, str] | None = None) -> JobEnv:
    """The job as seen from this process (pass `environ` to read another mapping, e.g. in tests)."""
    env = os.environ if environ is None else environ
    if "HPCFT_RANK" in env:
        return _from_hpcft(env)
    if "RANK" in env and "WORLD_SIZE" in env:
        return _from_torchrun(env)
    if "SLURM_PROCID" in env:
        return _from_slurm(env)
    return _local(env)


def in_allocation(environ: Mapping[str, str] | None = None) -> bool:
    """True inside a Slurm allocation (batch script, salloc shell or srun step)."""
    env = os.environ if environ is None else environ
    return bool(env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID"))


def usable_cores() -> int:
    """The cores this process may run on (its affinity: a Slurm task's -c), not the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


NVME_ENV = "HPCFT_NVME"  # exported by the batch script of `hpcft submit --nvme` (Frontier: /mnt/bb/$USER)


def expand_vars(value: str, environ: Mapping[str, str] | None = None) -> str:
    """`value` with `$VAR`/`${VAR}` of `environ` (default os.environ) replaced on the node that reads it (a per-node
    directory on a shared file system, `/tmp/nvme/$SLURMD_NODENAME`, for test clusters)."""
    env = os.environ if environ is None else environ
    for key in sorted((k for k in env if f"${k}" in value or f"${{{k}}}" in value), key=len, reverse=True):
        value = value.replace(f"${{{key}}}", env[key]).replace(f"${key}", env[key])
    return value


def nvme_dir(environ: Mapping[str, str] | None = None) -> str | None:
    """The node-local NVMe directory of this job ($HPCFT_NVME, `$VAR`s expanded here) when it exists on this node,
    else None: the durable tier's first level goes under it (hpcft.durable.local)."""
    path = expand_vars((os.environ if environ is None else environ).get(NVME_ENV) or "", environ)
    return path if path and os.path.isdir(path) else None
