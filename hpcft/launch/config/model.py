"""`hpcft run`'s options: one model, typed sections of fields, each with its default and help. The command line
(launch/config/command.py), the config file, the HPCFT_<NAME> environment variables and the configuration reference
(docs/configuration.md) are generated from it; precedence CLI > environment > file > default."""
import logging
import os
import tomllib
from collections.abc import Mapping
from dataclasses import Field, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from hpcft.agent.protection.budget import LAG_STEPS
from hpcft.agent.protection.placement import Scheme
from hpcft.agent.transport.heartbeat import LOSS_TIMEOUT_S
from hpcft.elastic import KEEP_GLOBAL, KEEP_PER_RANK
from hpcft.errors import ConfigError
from hpcft.launch.config.detect import Devices, detect
from hpcft.launch.config.memplan import parse_bytes

CONFIG_ENV = "HPCFT_CONFIG"
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
                                 "is in by then); 0: no heartbeats, a node is lost when its connections close or "
                                 "Slurm marks it.", bound=">=0")
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


@dataclass(frozen=True)
class RunConfig:
    """Every option of `hpcft run`, by section; a collaborator is handed the section it needs."""

    launch: Launch = field(default_factory=Launch)
    recovery: Recovery = field(default_factory=Recovery)
    protection: Protection = field(default_factory=Protection)
    memory: Memory = field(default_factory=Memory)
    durable: Durable = field(default_factory=Durable)
    elastic: Elastic = field(default_factory=Elastic)
    stragglers: Stragglers = field(default_factory=Stragglers)
    standby: Standby = field(default_factory=Standby)
    broadcast: Broadcast = field(default_factory=Broadcast)

    @property
    def with_agents(self) -> bool:
        """Whether node agents run next to the trainers: to protect, to flush, or both."""
        return self.protection.protected or self.durable.persisting

    def but(self, **changes: Any) -> "RunConfig":
        """This configuration with options changed by name (e.g. `cfg.but(nodes=3, group=3)`)."""
        by_section: dict[str, dict[str, Any]] = {}
        for name, value in changes.items():
            if name not in OPTIONS:
                raise ConfigError(f"unknown option {name!r}; valid options: {', '.join(KEYS)}")
            by_section.setdefault(OPTIONS[name][0], {})[name] = value
        return replace(self, **{s: replace(getattr(self, s), **v) for s, v in by_section.items()})


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in fields(RunConfig)}  # type: ignore[misc]
OPTIONS: dict[str, tuple[str, Field]] = {f.name: (s, f) for s, cls in SECTIONS.items() for f in fields(cls)}
KEYS = tuple(OPTIONS)


def make(**options: Any) -> RunConfig:
    """A validated RunConfig from options by name (the defaults for the rest)."""
    cfg = RunConfig().but(**options)
    validate(cfg)
    return cfg


def env_name(key: str) -> str:
    return f"HPCFT_{key.upper()}"


def kind_of(spec: Field) -> str:
    """An option's type as a word: int, float, bool or str (None allowed or not)."""
    return spec.type.__name__ if isinstance(spec.type, type) else str(spec.type).split(" ")[0]


_BOOLS = {**dict.fromkeys(("1", "true", "yes", "on"), True), **dict.fromkeys(("0", "false", "no", "off"), False)}


def _coerce(key: str, value: Any, where: str) -> Any:
    spec = OPTIONS[key][1]
    kind = kind_of(spec)
    if value is None:
        return None
    try:
        if spec.metadata["size"]:
            return parse_bytes(value)
        if kind.startswith("int"):
            if isinstance(value, bool):
                raise ValueError
            return int(value)
        if kind.startswith("float"):
            return float(value)
        if kind.startswith("bool"):
            return value if isinstance(value, bool) else _BOOLS[str(value).strip().lower()]
        return str(value)
    except (TypeError, ValueError, KeyError):
        raise ConfigError(f"{where}: {key}={value!r} is not a valid {kind}") from None


def _check_keys(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    out = {}
    for raw, value in data.items():
        key = raw.replace("-", "_")
        if key not in OPTIONS:
            raise ConfigError(f"{where}: unknown option {raw!r}; valid options: {', '.join(KEYS)}")
        out[key] = _coerce(key, value, where)
    return out


def read_toml(path: str | os.PathLike) -> dict[str, Any]:
    """The config file's contents; ConfigError naming the file when it is missing or not TOML."""
    p = Path(path)
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {p} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {p} is not valid TOML: {exc}") from None


def from_file(path: str | os.PathLike) -> dict[str, Any]:
    """Options from a TOML file: top-level keys, a [run] table, or a table per section ([protection], ...)."""
    p = Path(path)
    data = read_toml(p)
    data.pop("site", None)  # the sbatch script's site settings (hpcft/launch/config/site.py)
    if isinstance(data.get("run"), dict):
        data = data["run"]
    flat = {k: v for k, v in data.items() if not (k in SECTIONS and isinstance(v, dict))}
    for name in SECTIONS:
        table = data.get(name)
        if isinstance(table, dict):
            wrong = [k for k in table if OPTIONS.get(k.replace("-", "_"), (name,))[0] != name]
            if wrong:
                raise ConfigError(f"config file {p}: [{name}] has no option {wrong[0]!r}; its options: "
                                  f"{', '.join(f.name for f in fields(SECTIONS[name]))}")
            flat.update(table)
    return _check_keys(flat, f"config file {p}")


def from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """Options set as HPCFT_<NAME> (e.g. HPCFT_SPARES=2); only these names are read."""
    return {k: _coerce(k, environ[env_name(k)], f"environment variable {env_name(k)}")
            for k in KEYS if environ.get(env_name(k), "") != ""}


def load(cli: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None,
         config_file: str | os.PathLike | None = None, node: Devices | None = None) -> RunConfig:
    """Merge defaults < file (`config_file` or $HPCFT_CONFIG) < environment < CLI (None means not given); a profile
    given nowhere is detected from the environment and `node`, the GPUs of the node that trains (detect.py)."""
    env = os.environ if environ is None else environ
    merged: dict[str, Any] = {}
    path = config_file or env.get(CONFIG_ENV)
    if path:
        merged.update(from_file(path))
    merged.update(from_env(env))
    merged.update(_check_keys({k: v for k, v in (cli or {}).items() if v is not None}, "command line"))
    if merged.get("profile") is None:
        merged["profile"], why = detect(env, node)
        logging.getLogger("hpcft.events").info("profile %s detected (%s); --profile chooses another",
                                               merged["profile"], why)
    return make(**merged)


def validate(cfg: RunConfig) -> None:
    """Reject values no run can use, naming the option and what to do (the allocation's shape: `check_shape`)."""
    launch, rec, prot, mem = cfg.launch, cfg.recovery, cfg.protection, cfg.memory
    for key, (section, spec) in OPTIONS.items():
        value, bound = getattr(getattr(cfg, section), key), spec.metadata["bound"]
        if bound and value is not None and not (value > 0 if bound == ">0" else value >= int(bound[2:])):
            raise ConfigError(f"{key} must be {BOUNDS[bound]} (got {value:g})")
        if spec.metadata["choices"] and value not in spec.metadata["choices"]:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(spec.metadata['choices'])}: choose one")
    if not 0 <= mem.memory_headroom < 1:
        raise ConfigError(f"memory_headroom must be a fraction in [0, 1) (got {mem.memory_headroom})")
    if prot.agent_mpi is not None and not prot.agent_mpi.replace("_", "").isalnum():
        raise ConfigError(f"agent_mpi={prot.agent_mpi!r} is not an srun MPI plugin name (srun --mpi=list shows "
                          "them: pmix, pmi2, cray_shasta, ...)")
    if rec.lost_progress_exit in OWN_EXITS or not 0 <= rec.lost_progress_exit < 126:
        raise ConfigError(f"lost_progress_exit must be 0 (off) or an exit status from 6 to 125: 1-5 are hpcft run's "
                          f"other statuses, 126 and up the shell's and signals' (got {rec.lost_progress_exit})")
    _validate_elastic(cfg)
    _validate_stragglers(cfg)
    bad = [m for m in cfg.standby.preload.split(",")
           if m.strip() and not all(p.isidentifier() for p in m.strip().split("."))]
    if bad:
        raise ConfigError(f"preload: {', '.join(map(repr, bad))} is not a module name; give dotted names separated "
                          "by commas, e.g. --preload torch,transformers")
    if prot.protect not in ("auto", "none"):
        prot.scheme()  # the agents' own checks, before any step
    if launch.copy and launch.copy.strip().lower() not in ("auto", "default"):
        from hpcft.snapshot.calibration.policy import default_choice, parse_override  # needs crc32c: only here

        parse_override(launch.copy, default_choice(1, "fused"))  # the trainers' own parse, before anything is launched


def _validate_elastic(cfg: RunConfig) -> None:
    """--elastic needs what a shrink rebuilds and writes from: protection across nodes and a durable tier."""
    el, nodes = cfg.elastic, cfg.launch.nodes
    if el.min_nodes is not None and nodes is not None and el.min_nodes > nodes:
        raise ConfigError(f"min_nodes {el.min_nodes} is more than nodes {nodes}: an elastic job shrinks from "
                          "--nodes down to --min-nodes; lower --min-nodes or raise --nodes")
    if not el.elastic:
        if el.min_nodes is not None:
            raise ConfigError("min_nodes is given without elastic: add --elastic, or drop --min-nodes")
        if el.elastic_grow:
            raise ConfigError("elastic_grow is given without elastic (only a job that shrank can grow back): add "
                              "--elastic, or drop --elastic-grow")
        return
    if not cfg.protection.protected:
        raise ConfigError("elastic needs protection across nodes (a shrink rebuilds the lost node's snapshot from "
                          "parity): drop --protect none, or drop --elastic")
    if not cfg.durable.persisting:
        raise ConfigError("elastic needs a durable tier (a shrink writes the protected step there and the smaller "
                          "job reshards from it): drop --persist-dir none, or drop --elastic")


def _validate_stragglers(cfg: RunConfig) -> None:
    """A straggler is judged against a factor above 1; an eviction resumes from protection."""
    st = cfg.stragglers
    if 0 < st.straggler_factor <= 1:
        raise ConfigError(f"straggler_factor must be above 1 (how many times slower than the peers; got "
                          f"{st.straggler_factor:g}), or 0 to turn the detection off")
    if st.evict_stragglers and not cfg.protection.protected:
        raise ConfigError("evict_stragglers needs protection across nodes (the spare rebuilds the evicted node's "
                          "snapshot from its peers): drop --protect none, or drop --evict-stragglers")
    if st.evict_stragglers and not st.straggler_factor:
        raise ConfigError("evict_stragglers is given with straggler_factor 0 (detection off): set a factor above 1, "
                          "or drop --evict-stragglers")
