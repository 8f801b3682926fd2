"""Machine profiles: tasks per node, srun resource options and communication-library environment defaults.

Environment defaults apply only where the user has not set the variable: a site or user setting always wins.
Values may name `{user}` and `{job}`, filled in per job (e.g. MIOpen's database on node-local /tmp)."""
from collections.abc import Mapping
from dataclasses import dataclass, field

from hpcft.errors import ConfigError


@dataclass(frozen=True)
class Profile:
    """How one kind of node is used: one task per device, its CPUs and binding, and library settings."""

    name: str
    tasks_per_node: int
    srun_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    description: str = ""
    # The node agent's CPU cap in cores, where a share of the node's cores is the wrong unit (None: the agent's
    # default share). Trainers computing on the CPU meet at barriers on every core: each ms an agent takes on
    # any core delays the whole step by about that ms, however many cores the node has.
    agent_cpu_cores: float | None = None


# OLCF's PyTorch-on-Frontier guidance: srun -c7 --gpus-per-task=1 --gpu-bind=closest, 8 GCDs per node;
# NCCL_SOCKET_IFNAME=hsn0; MIOPEN_USER_DB_PATH / MIOPEN_CUSTOM_CACHE_DIR on node-local /tmp (avoids MIOpen
# disk I/O errors on the shared file system); NCCL_NET_GDR_LEVEL=3 and NCCL_CROSS_NIC=1 as performance
# settings; FI_CXI_ATS=0 for RCCL over the aws-ofi-rccl libfabric plugin on Slingshot. TORCH_GLOO_LAZY_INIT=1:
# the gloo half of the `cpu:gloo,cuda:nccl` groups (and hpcft's own gloo groups) connects a pair of ranks when a
# collective first uses it, not every pair at creation (a full mesh of 75,000 ranks would not fit in file descriptors).
GPU_ENV = {"TORCH_GLOO_LAZY_INIT": "1"}
FRONTIER = Profile(
    name="frontier",
    tasks_per_node=8,
    srun_args=("--cpus-per-task=7", "--gpus-per-task=1", "--gpu-bind=closest"),
    env={
        "NCCL_SOCKET_IFNAME": "hsn0",
        "GLOO_SOCKET_IFNAME": "hsn0",
        "NCCL_NET_GDR_LEVEL": "3",
        "NCCL_CROSS_NIC": "1",
        "FI_CXI_ATS": "0",
        "MIOPEN_USER_DB_PATH": "/tmp/hpcft-miopen-{user}-{job}",
        "MIOPEN_CUSTOM_CACHE_DIR": "/tmp/hpcft-miopen-{user}-{job}",
        "OMP_NUM_THREADS": "7",
        **GPU_ENV,
    },
    description="OLCF Frontier: 8 MI250X GCDs per node, one task per GCD, 7 cores each, RCCL over Slingshot",
)

CUDA = Profile(
    name="cuda",
    tasks_per_node=4,
    srun_args=("--gpus-per-task=1", "--gpu-bind=closest"),
    env=GPU_ENV,
    description="a generic NVIDIA node: one task per GPU (set tasks_per_node to the GPU count)",
)

CPU = Profile(name="cpu", tasks_per_node=1, description="one task per node, gloo on CPUs (tests, the sandbox)",
              agent_cpu_cores=0.01)

PROFILES: dict[str, Profile] = {p.name: p for p in (FRONTIER, CUDA, CPU)}


def get(name: str) -> Profile:
    """The profile called `name`; ConfigError listing the known ones otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ConfigError(f"unknown profile {name!r}; choose one of: {', '.join(PROFILES)}") from None


def env_defaults(profile: Profile, environ: Mapping[str, str], *, user: str, job: str) -> dict[str, str]:
    """The profile's variables the user has not set (in `environ`), with {user} and {job} filled in."""
    return {k: v.format(user=user, job=job) for k, v in profile.env.items() if k not in environ}
