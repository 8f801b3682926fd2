"""Machine profiles: tasks per node, srun resource options and library environment defaults, which apply only where
the user has not set the variable; values may name `{user}` and `{job}`, filled in per job."""
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
    # Each node agent's CPU budget in cores (`hpcft run --agent-cores`), a cap over the node's cores at a priority
    # below the trainers' (docs/reference/protection.md, "The CPU budget"): GPU trainers leave most host cores idle
    # while the devices compute; CPU trainers meet at barriers on every core, so each ms an agent takes on any core
    # delays the whole step by about that ms.
    agent_cpu_cores: float = 1.0
    # RCCL needs its network plugin between nodes: checked by `hpcft doctor` and at the start of `hpcft run`
    net_plugin: bool = False
    # the interface the node agents' bulk traffic binds to (None: the address of the node's hostname)
    agent_iface: str | None = None
    # the site's module lines of `hpcft submit`, unless the config file's [site] modules say otherwise
    modules: tuple[str, ...] = ()
    # `hpcft run --broadcast-env` unless the user says otherwise, where the job has node-local NVMe ($HPCFT_NVME)
    broadcast_env: bool = False
    # the agents' srun MPI plugin (--mpi=…) with --agent-transport mpi: the one the site's MPI starts under
    agent_mpi: str = "pmix"


# OLCF's PyTorch-on-Frontier guide (olcf-user-docs software/analytics/pytorch_frontier.rst, 2026-07): srun -c7
# --gpus-per-task=1 --gpu-bind=closest, 8 GCDs per node; MIOPEN_USER_DB_PATH / MIOPEN_CUSTOM_CACHE_DIR on node-local
# /tmp (avoids MIOpen disk I/O errors on the shared file system); and the RCCL/libfabric variables it lists as
# "strongly recommended by HPE and AMD on Frontier for both correctness and best performance at scale" (those the
# rccl-net-plugin module sets). Not set by default, as OLCF gives them only as things to try or with a condition:
# NCCL_NET=OFI (fail instead of falling back to sockets; not for 1-node jobs), NCCL_SOCKET_IFNAME=hsn0 alone (if
# the four-NIC list hangs), NCCL_ALGO, NCCL_DEBUG; FI_CXI_RDZV_PROTO=alt_read only when the allocation has
# --network=disable_rdzv_get (`conditional_env`). FI_MR_CACHE_MONITOR: kdreg2 is Frontier's default since 2025-05
# (userfaultfd is also safe with the plugin, memhooks can deadlock: `hpcft doctor` says so).
# TORCH_GLOO_LAZY_INIT=1: the gloo half of the `cpu:gloo,cuda:nccl` groups (and hpcft's own gloo groups) connects a
# pair of ranks when a collective first uses it, not every pair at creation (a full mesh of 75,000 ranks would not
# fit in file descriptors). TRITON_CACHE_DIR: the kernel of hpcft's device checksum (hpcft.snapshot.devcrc) is compiled
# when a process makes its Checkpointer, and cached; on node-local /tmp, not a home directory every node writes at once.
GPU_ENV = {"TORCH_GLOO_LAZY_INIT": "1", "TRITON_CACHE_DIR": "/tmp/hpcft-triton-{user}-{job}"}
FRONTIER_RCCL_ENV = {
    "NCCL_CROSS_NIC": "1",
    "NCCL_NET_GDR_LEVEL": "PHB",
    "NCCL_SOCKET_IFNAME": "hsn0,hsn1,hsn2,hsn3",
    "HSA_FORCE_FINE_GRAIN_PCIE": "1",
    "FI_MR_CACHE_MONITOR": "kdreg2",
    "FI_CXI_DISABLE_HOST_REGISTER": "1",
    "FI_CXI_DEFAULT_CQ_SIZE": "131072",
    "FI_CXI_RDZV_EAGER_SIZE": "0",
    "FI_CXI_RDZV_THRESHOLD": "0",
    "FI_CXI_RDZV_GET_MIN": "0",
    "FI_CXI_DEFAULT_TX_SIZE": "2048",
    "FI_CXI_RX_MATCH_MODE": "hybrid",
}
FRONTIER = Profile(
    name="frontier",
    tasks_per_node=8,
    srun_args=("--cpus-per-task=7", "--gpus-per-task=1", "--gpu-bind=closest"),
    env={
        **FRONTIER_RCCL_ENV,
        "GLOO_SOCKET_IFNAME": "hsn0",
        "MIOPEN_USER_DB_PATH": "/tmp/hpcft-miopen-{user}-{job}",
        "MIOPEN_CUSTOM_CACHE_DIR": "/tmp/hpcft-miopen-{user}-{job}",
        "OMP_NUM_THREADS": "7",
        **GPU_ENV,
    },
    description="OLCF Frontier: 8 MI250X GCDs per node, one task per GCD, 7 cores each, RCCL over Slingshot",
    net_plugin=True,
    agent_iface="hsn0",
    modules=("PrgEnv-gnu", "rocm", "rccl-net-plugin", "craype-accel-amd-gfx90a"),
    broadcast_env=True,  # OLCF recommends it at scale (software/python/sbcast_conda.rst): docs/reference/startup.md
    agent_mpi="cray_shasta",  # Cray MPICH's PMI under HPE's Slurm (OLCF's srun default; mpi4py built on cray-mpich)
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


def conditional_env(profile: Profile, environ: Mapping[str, str]) -> dict[str, str]:
    """OLCF's alternative rendezvous protocol, only with --network=disable_rdzv_get (Slurm's SLURM_NETWORK)."""
    if profile.net_plugin and "disable_rdzv_get" in environ.get("SLURM_NETWORK", ""):
        return {"FI_CXI_RDZV_PROTO": "alt_read"}
    return {}


def env_defaults(profile: Profile, environ: Mapping[str, str], *, user: str, job: str,
                 plugin: Mapping[str, str] | None = None) -> dict[str, str]:
    """The profile's variables the user has not set, {user} and {job} filled in, then `plugin` (netplugin's)."""
    out = {k: v.format(user=user, job=job) for k, v in {**profile.env, **conditional_env(profile, environ)}.items()
           if k not in environ}
    return {**out, **(plugin or {})}
