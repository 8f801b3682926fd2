"""`hpcft.init()`: ranks and device from the job environment, the process groups of a declared layout."""
import logging
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hpcft.env import JobEnv, job_env
from hpcft.errors import ConfigError, RendezvousError
from hpcft.store import prefetch

_log = logging.getLogger(__name__)
DIMS = ("pp", "dp", "tp")  # outermost to innermost: tensor parallel stays inside a node


@dataclass(frozen=True)
class Context:
    """What a training script needs from the job: who it is, where it computes, which groups it is in."""
    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str
    job_id: str
    dp: int
    tp: int
    pp: int
    mesh: Any          # torch DeviceMesh with dims ("pp", "dp", "tp")
    dp_group: Any
    tp_group: Any
    pp_group: Any
    env: JobEnv

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp")

    @property
    def tp_rank(self) -> int:
        return self.mesh.get_local_rank("tp")

    @property
    def pp_rank(self) -> int:
        return self.mesh.get_local_rank("pp")

    def close(self) -> None:
        """Tear down the process groups (end of training)."""
        if dist.is_initialized():
            dist.destroy_process_group()


def resolve_layout(world: int, dp: int | None, tp: int, pp: int) -> tuple[int, int, int]:
    """(dp, tp, pp) with dp defaulting to what is left; ConfigError unless dp*tp*pp == world."""
    for name, v in (("tp", tp), ("pp", pp), ("dp", dp)):
        if v is not None and v < 1:
            raise ConfigError(f"{name} must be a positive integer (got {v})")
    if dp is None:
        if world % (tp * pp):
            raise ConfigError(f"world size {world} is not divisible by tp*pp = {tp}*{pp}; change tp/pp or the task "
                              "count")
        dp = world // (tp * pp)
    if dp * tp * pp != world:
        raise ConfigError(f"layout dp={dp} x tp={tp} x pp={pp} = {dp * tp * pp} does not match world size {world}")
    return dp, tp, pp


def pick_device(local_rank: int) -> torch.device:
    """The GPU for this local rank (ROCm and CUDA both appear as torch.cuda), else the CPU."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def default_backend(device: torch.device) -> str:
    """gloo on CPUs; on GPUs NCCL (RCCL on ROCm) for the device and gloo for CPU tensors in the same groups, so CPU
    collectives work on every group made from the default one."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def wait_listening(host: str, port: int, timeout_s: float, poll_s: float = 0.005) -> bool:
    """Wait until something accepts connections on host:port: True; False for a host that does not resolve (torch
    says so); RendezvousError at the deadline. Why: torch's TCPStore client that connects before rank 0 listens
    sleeps out a backoff of up to a second, which a warm relaunch (every rank started at once) hits every time."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(poll_s, 0.5)):
                return True
        except socket.gaierror:
            return False
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise RendezvousError(
                    f"nothing listens on {host}:{port} (MASTER_ADDR:MASTER_PORT, rank 0's rendezvous) after "
                    f"{timeout_s:g} s ({exc.strerror or exc}): rank 0 did not start or died before joining (see its "
                    "log), or MASTER_ADDR/MASTER_PORT name another place than rank 0's node") from None
            time.sleep(poll_s)


def init(*, dp: int | None = None, tp: int = 1, pp: int = 1, backend: str | None = None,
         timeout_s: float = 600.0, environ: dict[str, str] | None = None, store: Any = None) -> Context:
    """Join the job: read the launcher's (or torchrun's, Slurm's) variables, pick the device, initialise
    torch.distributed (`default_backend` unless `backend`) and build a (pp, dp, tp) DeviceMesh. `store`: rendezvous
    on this torch Store instead of the job's address (an in-process restart's generation)."""
    env = job_env(environ)
    dp, tp, pp = resolve_layout(env.world_size, dp, tp, pp)
    device = pick_device(env.local_rank)
    backend = backend or default_backend(device)
    if not dist.is_initialized():
        if store is None:
            # a relaunch's snapshot, mapped while the ranks meet (this thread only waits for them meanwhile)
            prefetch.ahead(env.job_id, env.rank, threads=prefetch.threads())
            if env.rank != 0:
                wait_listening(env.master_addr, env.master_port, timeout_s)
        where = {"store": store} if store is not None else {"init_method": f"tcp://{env.master_addr}:{env.master_port}"}
        dist.init_process_group(backend, **where, rank=env.rank, world_size=env.world_size,
                                timeout=timedelta(seconds=timeout_s))
    elif dist.get_world_size() != env.world_size:
        raise ConfigError(f"torch.distributed is already initialised with {dist.get_world_size()} ranks, "
                          f"the job environment says {env.world_size}")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=DIMS)
    _log.info("hpcft init: rank %d/%d local %d device %s backend %s dp=%d tp=%d pp=%d job %s",
              env.rank, env.world_size, env.local_rank, device, backend, dp, tp, pp, env.job_id)
    return Context(rank=env.rank, world=env.world_size, local_rank=env.local_rank, device=device,
                   backend=backend, job_id=env.job_id, dp=dp, tp=tp, pp=pp, mesh=mesh,
                   dp_group=mesh.get_group("dp"), tp_group=mesh.get_group("tp"), pp_group=mesh.get_group("pp"),
                   env=env)
