"""The sections of `hpcft run`'s options (launch/config/model.py puts them together): each option a field with its
default, its one help text, and its bounds or choices."""
from dataclasses import dataclass, field
from typing import Any

from hpcft.agent.protection.budget import LAG_STEPS
from hpcft.agent.protection.placement import Scheme
from hpcft.agent.transport.heartbeat import LOSS_TIMEOUT_S
from hpcft.elastic import KEEP_GLOBAL, KEEP_PER_RANK

LOST_PROGRESS_EXIT = 6  # after hpcft's own 1, 3, 4, 5; not the shell's or a signal's (126 and up)
OWN_EXITS = (1, 2, 3, 4, 5)  # hpcft's and click's exit statuses, which a lost-progress exit must not look like
PROTECT_SCHEMES = ("auto", "none", "partner", "xor", "rs")
AGENT_TRANSPORTS = ("tcp", "mpi")
ELASTIC_BATCH = (KEEP_GLOBAL, KEEP_PER_RANK)
PROFILES = ("cpu", "cuda", "frontier")
DEFAULT_GROUP = 4  # xor and rs sets of 4 unless fewer nodes train or --group says otherwise
DEFAULT_PRELOAD = ("torch,torch.nn,torch.optim,torch.distributed,torch.distributed.device_mesh,"
                   "torch.nn.parallel,torch._dynamo,torch._inductor.config,torch.distributed.checkpoint.state_dict,"
                   "numpy,hpcft.runtime,hpcft.checkpointer")
BOUNDS = {">=0": "0 or more", ">=1": "at least 1", ">0": "positive"}


def option(default: Any, help: str, *, daily: bool = False, choices: tuple[str, ...] = (), metavar: str = "",
           size: bool = False, bound: str = "") -> Any:
    """A field of a section: `help` is its one text (--help, the reference); `daily` shows it in `hpcft run --help`
    (the rest under --help-all); `size`: bytes, also written 64G or 1.5TiB; `bound`: a key of BOUNDS."""
    return field(default=default, metadata={"help": help, "daily": daily, "choices": choices, "metavar": metavar,
                                            "size": size, "bound": bound})


@dataclass(frozen=True)
class Launch:
    """Where the trainers run and how they are started."""

    nodes: int | None = option(None, "Active nodes (default: the allocation minus the spares).", daily=True,
                               bound=">=1")
    spares: int = option(0, "Nodes held back to replace failed ones.", daily=True, bound=">=0")
    profile: str = option("cpu", "Machine profile: tasks per node, srun options, library environment (default: "
                          "detected: frontier where SLURM_CLUSTER_NAME or LMOD_SYSTEM_NAME says so, else cuda on a GPU "
                          "node, else cpu).", daily=True, choices=PROFILES)
    profile_check: bool = option(True, "Refuse a profile that does not fit the node `hpcft run` starts on (GPU "
                                 "profiles without GPUs, cpu with GPUs); off where a profile is forced on purpose.")
    tasks_per_node: int | None = option(None, "Trainer tasks per node (default: the profile's).", bound=">=1")
    job_dir: str | None = option(None, "Where events, decisions and progress go (default ./hpcft-<job id>).",
                                 daily=True)
    srun_args: str = option("", "Extra srun options for the trainers' step, as one string.", daily=True)
    poll_interval: float = option(1.0, "Seconds between checks of the step, the nodes' reports and the agents "
                                  "(Slurm itself is asked less often: --slurm-check-every).", bound=">0")
    kill_grace: float = option(10.0, "Seconds between SIGTERM and SIGKILL of a step.", bound=">=0")
    copy: str | None = option(None, "The trainers' CPU snapshot/restore copy method, exported as HPCFT_COPY: auto "
                              "(measured once per host and cached, the default), default, or pinned, e.g. "
                              "stream,threads=2,chunk=1M (hpcft/snapshot/calibration).")
    adopt: str | None = option(None, "A job whose snapshots in the nodes' memory the restore and the agents' rebuild "
                               "take too (another job's are refused), exported as HPCFT_ADOPT.", metavar="JOB")


@dataclass(frozen=True)
class Recovery:
    """When a failure is a relaunch, a requeue or the end, and how failures are found."""

    max_restarts: int = option(3, "Relaunches allowed before giving up (requeues not counted).", daily=True,
                               bound=">=0")
    hang_timeout: float = option(0.0, "Seconds without a completed step = hung (0: off).", daily=True, bound=">=0")
    start_timeout: float = option(0.0, "With --hang-timeout: seconds a launch may take to its first completed step "
                                  "(start-up, process groups, restore) before it counts as hung (0: the hang timeout).",
                                  bound=">=0")
    requeue: bool = option(True, "Allow `scontrol requeue` when the walltime nears or no relaunch is possible.")
    takeover: bool = option(True, "When the node running hpcft run is lost, a janitor on another node of the job "
                            "becomes the supervisor in the same allocation (else the job is requeued).")
    requeue_margin: float = option(300.0, "With less walltime left than this (s), persist and requeue instead of "
                                   "relaunching.", bound=">=0")
    probe_timeout: float = option(15.0, "Seconds a node health probe may take.", bound=">0")
    slurm_check_every: float = option(60.0, "Seconds between the supervisor's looks at its nodes in Slurm while the "
                                      "trainers run (one `scontrol show node`, 2 RPCs at slurmctld: an admin's drain "
                                      "is seen within this). Slurm is also asked at launch, at decisions and at once "
                                      "on suspicion (an srun error, a node's reports silent); the step's exit and the "
                                      "agents' heartbeats find a lost node. Below 30 s the job polls slurmctld more "
                                      "than sites allow.", bound=">0")
    loss_timeout: float = option(LOSS_TIMEOUT_S, "Seconds without a heartbeat after which a node agent names its peer "
                                 "lost, once its node fails a probe (started ahead, after half of it: the verdict "
                                 "is in by then), and the janitors the supervisor's node; 0: no heartbeats, a node is "
                                 "lost when its connections close or Slurm marks it (the janitors wait 5 s).",
                                 bound=">=0")
    lost_progress_exit: int = option(LOST_PROGRESS_EXIT, "Exit status of a run that finished but lost progress on "
                                     "the way (resumed from an older step than its trainers had reached), so that it "
                                     "cannot pass for a clean success (0: exit 0).", metavar="N")


@dataclass(frozen=True)
class Protection:
    """The node agents' in-memory protection across nodes (docs/reference/protection.md)."""

    protect: str = option("auto", "Scheme (auto: xor from 3 nodes, partner on 2, none on 1; none: no agents).",
                          daily=True, choices=PROTECT_SCHEMES)
    group: int | None = option(None, "Set size for xor and rs (default: 4, or the active nodes where fewer).",
                               daily=True, bound=">=1")
    losses: int = option(1, "Node losses tolerated per set (rs).", bound=">=0")
    distance: int = option(1, "Partner distance in slots (partner).", bound=">0")
    protect_rate: float | None = option(None, "Bytes/s cap on protection traffic (default: the agents' own).",
                                        bound=">0")
    protect_timeout: float = option(300.0, "Seconds the agents may take to be ready (rebuild included) before the "
                                    "launch counts as failed.", bound=">=0")
    protect_lag: int = option(LAG_STEPS, "Steps protection may trail the newest snapshot: while it would, the agents' "
                              "CPU cap rises (up to 4 budgets, 1 core at least) and they run at the trainers' "
                              "priority (0: a fixed cap, protection may trail any distance).", daily=True, bound=">=0")
    agent_cores: float | None = option(None, "Each node agent's CPU budget in cores, taken from what the trainers "
                                       "leave idle (below their priority, over the node's cores; default: the "
                                       "profile's, 1 on frontier and cuda, 0.01 on cpu).", bound=">=0")
    agent_iface: str | None = option(None, "Network interface the agents bind to (default: the profile's, hsn0 on "
                                     "Frontier; a node without it uses its hostname's address, with a warning).")
    agent_transport: str = option("tcp", "What carries the agents' bulk data and agreements: tcp, or mpi (mpi4py over "
                                  "the site's MPI; the heartbeats stay on TCP).", choices=AGENT_TRANSPORTS)
    agent_mpi: str | None = option(None, "With --agent-transport mpi: the srun MPI plugin of the agents' step "
                                   "(default: the profile's, pmix; cray_shasta on Frontier).")

    @property
    def protected(self) -> bool:
        """Whether the node agents protect snapshots across nodes."""
        return self.protect != "none"

    def scheme(self) -> Scheme:
        """The node agents' placement.Scheme for this section (ConfigError naming a bad value)."""
        return Scheme(self.protect, self.group or DEFAULT_GROUP, self.losses, self.distance)


@dataclass(frozen=True)
class Memory:
    """The memory plan checked before the first launch and after the first snapshot (hpcft/launch/config/memplan.py)."""

    keep: int = option(2, "The Checkpointer's keep (versions kept per rank), for the plan.", bound=">=1")
    state_bytes: int | None = option(None, "One snapshot's bytes on one node, all its ranks (e.g. 120G; unknown: "
                                     "checked after the first snapshot only).", size=True, bound=">0")
    node_memory: int | None = option(None, "Memory per node to plan with (e.g. 512G; default: what the batch host's "
                                     "/dev/shm and MemAvailable offer).", size=True, bound=">0")
    memory_headroom: float = option(0.2, "Fraction of node memory left to the trainers and the system.")


@dataclass(frozen=True)
class Durable:
    """The agents' flush to the durable tier on a shared file system (docs/reference/durable.md)."""

    persist_dir: str | None = option(None, "The durable tier on a shared file system (default <job dir>/checkpoints; "
                                     "none: no flushing).", daily=True)
    persist_every: int = option(100, "Flush every this many protected steps (and before a requeue).", daily=True,
                                bound=">=1")
    persist_keep: int = option(2, "Durable checkpoints kept.", bound=">=1")
    persist_rate: float | None = option(None, "Bytes/s cap on each node's flush writes.", bound=">0")
    persist_local: str | None = option(None, "The durable tier's node-local first level, written first and drained "
                                       "to --persist-dir ($VARs expanded on each node; default $HPCFT_NVME/"
                                       "hpcft-persist where `hpcft submit --nvme` gave one; none: off).")

    @property
    def persisting(self) -> bool:
        """Whether the node agents flush to the durable tier (on unless persist_dir is `none`)."""
        return (self.persist_dir or "").lower() != "none"


@dataclass(frozen=True)
class Elastic:
    """Continuing on fewer nodes when no spare is left, and growing back (hpcft/launch/reshape.py)."""

    elastic: bool = option(False, "With no spare left, continue on fewer nodes instead of requeueing.", daily=True)
    min_nodes: int | None = option(None, "With --elastic: below this many active nodes, requeue instead (default 1).",
                                   bound=">=1")
    elastic_batch: str = option(KEEP_GLOBAL, "What a shrink keeps: the global batch (each replica accumulates more "
                                "micro-batches) or each replica's batch, exported as HPCFT_ELASTIC_BATCH.",
                                choices=ELASTIC_BATCH)
    elastic_grow: bool = option(False, "With --elastic: grow back toward --nodes when nodes of the allocation return "
                                "to service.")
    grow_settle: float = option(60.0, "Seconds a returned node must stay healthy before it is taken back (doubled "
                                "for each earlier loss of that node).", bound=">=0")
    grow_every: float = option(300.0, "At most one grow per this many seconds after the last shrink or grow.",
                               bound=">=0")
    grow_max_losses: int = option(2, "A node lost more often than this in the run is not taken back.", bound=">=0")


@dataclass(frozen=True)
class Stragglers:
    """Finding slow nodes and replacing them (docs/reference/supervisor.md, "Stragglers")."""

    straggler_factor: float = option(1.5, "A node whose ranks' own share of a step is this many times the other "
                                     "nodes' median is a straggler (0: off).", bound=">=0")
    straggler_window: float = option(30.0, "Seconds of steps judged together.", bound=">0")
    evict_stragglers: bool = option(False, "Replace a straggler's node with a spare at the next protected step.")


@dataclass(frozen=True)
class Standby:
    """Warm standby processes: a relaunch starts no interpreter (hpcft/launch/node/standby.py)."""

    standby: bool = option(True, "A warm standby on every node runs the trainers' `python SCRIPT` / `python -m "
                           "MODULE` in a forked child (other commands run cold, said in an event).")
    preload: str = option(DEFAULT_PRELOAD, "Comma-separated modules the standbys import before a launch (add the "
                          "training script's own heavy modules).", metavar="MODULES")


@dataclass(frozen=True)
class Broadcast:
    """The Python environment copied to node-local storage and started from there (hpcft/launch/steps/broadcast.py)."""

    broadcast_env: bool | None = option(None, "Pack the interpreter's environment once, sbcast it to node-local "
                                        "storage "
                                    "and start every step from each node's copy (default: on with the frontier "
                                    "profile and node-local NVMe).")
    broadcast_dir: str | None = option(None, "That node-local directory, the same path on every node (default "
                                   "$HPCFT_NVME, else /tmp).")
    broadcast_cache: str | None = option(None, "Where the archives are kept, named by their content (default <job "
                                     "dir>/broadcast; a directory shared by several jobs reuses one archive).")
