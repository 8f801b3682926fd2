"""What a sandbox looks like (nodes, addresses, ports, paths) and the Slurm files rendered from it. Pure."""
import hashlib
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from hpcft.errors import ConfigError

MODES = ("netns", "local")
GPUS = 8  # the confined sandbox's fake GPUs per node, as a Frontier node's 8 GCDs
MAX_NODES = 64


def default_dir() -> Path:
    """The sandbox directory used when none is given: one per user, under the temp directory."""
    return Path(os.environ.get("TMPDIR", "/tmp")) / f"hpcft-sandbox-{os.getuid()}"


def _slurm_script(name: str) -> str | None:
    """hpcft's own slurm/<name>, as a cluster running hpcft would configure it, when this is a source tree."""
    path = Path(__file__).resolve().parents[2] / "slurm" / name
    return str(path) if path.is_file() else None


@dataclass(frozen=True)
class SandboxConfig:
    """Everything that decides a sandbox's shape; every field has a working default."""

    dir: Path = field(default_factory=default_dir)
    nodes: int = 4
    mode: str = "netns"
    ctld_port: int | None = None  # default: 6817 (netns) or 17000 (local)
    slurmd_port: int | None = None  # netns: every node's port (6818); local: the first node's (ctld_port + 1)
    subnet: str = "10.77.0"  # netns only: a /24 that exists only inside the sandbox's namespaces
    cpus: int = 4
    memory_mb: int = 1000
    shm_size: str = "2g"
    prolog: str | None = field(default_factory=lambda: _slurm_script("prolog.sh"))  # slurm.conf Prolog= (None: none)
    epilog: str | None = field(default_factory=lambda: _slurm_script("epilog.sh"))  # slurm.conf Epilog= (None: none)
    # task/cgroup + task/affinity, proctrack/cgroup, 8 fake GPUs per node (hpcft/sandbox/confine.py); the nodes then
    # declare this machine's real CPUs, not `cpus` (a cpuset holds only CPUs that exist)
    confine: bool = False
    # slurmdbd and its MariaDB, as a real cluster has: slurmctld takes updates of a job it resized only with them
    accounting: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "dir", Path(self.dir).absolute())
        if self.mode not in MODES:
            raise ConfigError(f"sandbox mode {self.mode!r} is not one of {', '.join(MODES)}")
        if not 1 <= self.nodes <= MAX_NODES:
            raise ConfigError(f"sandbox nodes must be between 1 and {MAX_NODES}, got {self.nodes}")
        octets = self.subnet.split(".")
        if len(octets) != 3 or not all(o.isdigit() and int(o) < 256 for o in octets):
            raise ConfigError(f"sandbox subnet must be the first three octets of a /24 (e.g. 10.77.0), "
                              f"got {self.subnet!r}")
        for name in ("ctld_port", "slurmd_port"):
            port = getattr(self, name)
            if port is not None and not 1 <= port <= 65535 - MAX_NODES:
                raise ConfigError(f"sandbox {name} {port} is out of range")

    @property
    def node_cpus(self) -> int:
        """The CPUs each node declares: `cpus`, or this machine's when confined."""
        return (os.cpu_count() or 1) if self.confine else self.cpus

    @property
    def tag(self) -> str:
        """A short name derived from the directory, so two sandboxes never share a namespace name."""
        return hashlib.sha1(str(self.dir).encode()).hexdigest()[:8]


@dataclass(frozen=True)
class NodeSpec:
    """One slurmd: its Slurm name, the hostname and address it is reached at, its port and namespace."""

    name: str
    hostname: str
    addr: str
    port: int
    netns: str | None


@dataclass(frozen=True)
class Layout:
    """The concrete sandbox: controller, nodes and the files every daemon shares."""

    config: SandboxConfig
    ctld_host: str
    ctld_addr: str
    ctld_port: int
    ctld_netns: str | None
    nodes: tuple[NodeSpec, ...]

    @property
    def dir(self) -> Path:
        return self.config.dir

    @property
    def slurm_conf(self) -> Path:
        return self.dir / "etc" / "slurm.conf"

    @property
    def slurmdbd_conf(self) -> Path:
        return self.dir / "etc" / "slurmdbd.conf"

    @property
    def db_dir(self) -> Path:
        """The accounting's MariaDB: data, socket, log."""
        return self.dir / "db"

    @property
    def dbd_port(self) -> int:
        """slurmdbd's port: Slurm's default in the controller's namespace; local: past the nodes' ports."""
        return 6819 if self.ctld_netns else self.ctld_port + MAX_NODES + 1

    @property
    def db_port(self) -> int:
        """MariaDB's port on 127.0.0.1 where slurmdbd runs."""
        return 3306 if self.ctld_netns else self.ctld_port + MAX_NODES + 2

    @property
    def mpi_conf(self) -> Path:
        return self.dir / "etc" / "mpi.conf"

    @property
    def cgroup_conf(self) -> Path:
        return self.dir / "etc" / "cgroup.conf"

    @property
    def gres_conf(self) -> Path:
        return self.dir / "etc" / "gres.conf"

    @property
    def gpu_dir(self) -> Path:
        """The confined sandbox's fake GPUs (confine.make_gpus)."""
        return self.dir / "dev"

    @property
    def hosts_file(self) -> Path:
        return self.dir / "etc" / "hosts"

    @property
    def munge_socket(self) -> Path:
        return self.dir / "munge" / "munge.socket"

    @property
    def pmix_dir(self) -> Path:
        return self.dir / "pmix"

    @property
    def log_dir(self) -> Path:
        return self.dir / "log"

    @property
    def local_dir(self) -> Path:
        """Each node's local disk, at this path on every node (a bind mount): as /tmp or a real node's NVMe."""
        return self.dir / "local"

    def local_disk(self, node: str) -> Path:
        """Where node `node`'s local disk is kept on the host."""
        return self.dir / "disks" / node

    def node(self, name: str) -> NodeSpec:
        """The node called `name`; a clear error names the nodes there are."""
        for spec in self.nodes:
            if spec.name == name:
                return spec
        raise ConfigError(f"no sandbox node {name!r}; nodes are {', '.join(n.name for n in self.nodes)}")


def plan(config: SandboxConfig, hostname: str | None = None) -> Layout:
    """Lay out controller and nodes: netns gives every node its own address; local shares 127.0.0.1."""
    names = [f"n{i}" for i in range(1, config.nodes + 1)]
    if config.mode == "netns":
        ctld_port = config.ctld_port or 6817
        port = config.slurmd_port or 6818
        prefix = f"hpcft-{config.tag}"
        nodes = tuple(NodeSpec(name, name, f"{config.subnet}.{10 + i}", port, f"{prefix}-{name}")
                      for i, name in enumerate(names, start=1))
        return Layout(config, "ctl", f"{config.subnet}.1", ctld_port, f"{prefix}-ctl", nodes)
    ctld_port = config.ctld_port or 17000
    first = config.slurmd_port or ctld_port + 1
    nodes = tuple(NodeSpec(name, "localhost", "127.0.0.1", first + i, None) for i, name in enumerate(names))
    host = (hostname or socket.gethostname()).split(".")[0]
    return Layout(config, host, "127.0.0.1", ctld_port, None, nodes)


def render_slurm_conf(layout: Layout) -> str:
    """slurm.conf for the sandbox: accounting through slurmdbd (or none), fast failure detection and requeue; no
    cgroups, or (confined) a real node's task/cgroup + task/affinity and proctrack/cgroup, and GPUs as GRES."""
    d = layout.dir
    lines = [
        "# Written by `hpcft sandbox up`; rewritten on every start.", "ClusterName=hpcft-sandbox",
        f"SlurmctldHost={layout.ctld_host}({layout.ctld_addr})", f"SlurmctldPort={layout.ctld_port}",
        "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={layout.munge_socket},cred_expire=10",
        f"StateSaveLocation={d}/state", f"SlurmdSpoolDir={d}/spool/%n",
        f"SlurmctldPidFile={d}/run/slurmctld.pid", f"SlurmdPidFile={d}/run/slurmd-%n.pid",
        f"SlurmctldLogFile={layout.log_dir}/slurmctld.log", f"SlurmdLogFile={layout.log_dir}/slurmd-%n.log",
        "SlurmctldDebug=info", "SlurmdDebug=info", "MailProg=/bin/true",
        *(("ProctrackType=proctrack/cgroup", "TaskPlugin=task/cgroup,task/affinity", "GresTypes=gpu")
          if layout.config.confine else ("ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none")),
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "SlurmdParameters=config_overrides",
        "MpiDefault=none", "JobAcctGatherType=jobacct_gather/none",
        *(("AccountingStorageType=accounting_storage/slurmdbd", f"AccountingStorageHost={layout.ctld_addr}",
           f"AccountingStoragePort={layout.dbd_port}", f"AccountingStoragePass={layout.munge_socket}")
          if layout.config.accounting
          else ("AccountingStorageType=accounting_storage/none",)),
        "SlurmdTimeout=10", "SlurmctldTimeout=10", "MessageTimeout=5", "KillWait=3",
        "ReturnToService=1", "JobRequeue=1", "SchedulerParameters=sched_interval=2,bf_interval=1",
    ]
    cfg = layout.config
    lines += [f"{key}={path}" for key, path in (("Prolog", cfg.prolog), ("Epilog", cfg.epilog)) if path]
    gres = f" Gres=gpu:{GPUS}" if cfg.confine else ""
    for node in layout.nodes:
        lines.append(f"NodeName={node.name} NodeHostname={node.hostname} NodeAddr={node.addr} Port={node.port} "
                     f"CPUs={cfg.node_cpus} RealMemory={cfg.memory_mb}{gres} State=UNKNOWN")
    lines.append("PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def render_slurmdbd_conf(layout: Layout) -> str:
    """slurmdbd.conf: the daemon on the controller's host, storing into the sandbox's MariaDB as root."""
    return "\n".join([
        "# Written by `hpcft sandbox up`; rewritten on every start.",
        f"DbdHost={layout.ctld_host}", f"DbdAddr={layout.ctld_addr}", f"DbdPort={layout.dbd_port}", "SlurmUser=root",
        "AuthType=auth/munge", f"AuthInfo=socket={layout.munge_socket}", f"LogFile={layout.log_dir}/slurmdbd.log",
        f"PidFile={layout.dir}/run/slurmdbd.pid", "DebugLevel=info", "StorageType=accounting_storage/mysql",
        "StorageHost=127.0.0.1", f"StoragePort={layout.db_port}", "StorageUser=root", "StorageLoc=slurm_acct_db",
    ]) + "\n"


# Open MPI (Debian's, PMIx only: srun --mpi=pmix) over TCP alone: its other components (UCX, libfabric, PSM, openib)
# probe for fabrics a CPU box lacks, which is slow and, under load, has crashed; the ranks yield while they wait
# (several ranks on a few loaded cores). What a job in the sandbox (or mpirun on this machine) exports for MPI.
OPEN_MPI_TCP_ENV = {"OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "self,tcp", "OMPI_MCA_osc": "^ucx",
                    "OMPI_MCA_mpi_yield_when_idle": "1"}


def render_mpi_conf(layout: Layout) -> str:
    """mpi.conf: PMIx client files go to a per-node private tmpfs mounted at the same path on every node."""
    return f"PMIxCliTmpDirBase={layout.pmix_dir}\n"


def render_hosts(layout: Layout) -> str:
    """/etc/hosts seen inside the sandbox's namespaces: the controller and every node by name."""
    lines = ["127.0.0.1 localhost"]
    if layout.ctld_netns is not None:
        lines.append(f"{layout.ctld_addr} {layout.ctld_host}")
        lines.extend(f"{n.addr} {n.hostname}" for n in layout.nodes)
    return "\n".join(lines) + "\n"
