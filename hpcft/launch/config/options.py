"""`hpcft run` options from three places, CLI > environment (HPCFT_<NAME>) > config file (TOML), one dataclass."""
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from hpcft.agent.transport.heartbeat import LOSS_TIMEOUT_S
from hpcft.elastic import KEEP_GLOBAL, KEEP_PER_RANK
from hpcft.errors import ConfigError
from hpcft.launch.config.memplan import parse_bytes
from hpcft.launch.node.standby import DEFAULT_PRELOAD
from hpcft.snapshot.calibration.policy import default_choice, parse_override

CONFIG_ENV = "HPCFT_CONFIG"
LOST_PROGRESS_EXIT = 6  # after hpcft's own 1, 3, 4, 5; not the shell's or a signal's (126 and up)
OWN_EXITS = (1, 2, 3, 4, 5)  # hpcft's and click's exit statuses, which a lost-progress exit must not look like


@dataclass(frozen=True)
class RunConfig:
    """Every option of the supervisor; the docstring of each field is its help text in docs/supervisor.md.

    nodes: active nodes (default: the allocation minus the spares); spares: nodes held back to replace failed
    ones; profile: frontier | cuda | cpu; tasks_per_node: overrides the profile's; max_restarts: relaunches
    allowed before giving up (requeues not counted); hang_timeout: seconds without a completed step before
    the step is killed as hung (0: off); start_timeout: with hang_timeout on, the seconds a launch may take to its
    first completed step (start-up, process groups, restore) before it counts as hung (0: the hang timeout), so that
    the hang timeout need not cover a start-up; poll_interval: seconds between checks of the step and the nodes;
    kill_grace: seconds between SIGTERM and SIGKILL of a step; requeue_margin: with less walltime left than
    this, persist and requeue instead of relaunching; requeue: allow `scontrol requeue` (else stop);
    job_dir: where events, decisions and progress go (default ./hpcft-<job id>); srun_args: extra srun
    options for the trainer step; probe_timeout: seconds a node health probe may take; loss_timeout: seconds without
    a heartbeat after which a node agent names its peer a suspect, whose node the supervisor then probes (0: no
    heartbeats, a node is found lost when its connections close or Slurm marks it); protect: auto | none |
    partner | xor | rs, the node agents' protection scheme (none: no agents step; auto: xor over sets of `group`
    where 3 or more nodes train, partner on 2, none on 1 — see `resolve_protect`); group, losses, distance:
    its set size, tolerated losses per set (rs) and partner distance; protect_rate: bytes/s cap on protection
    traffic (default: the agents' own); protect_timeout: seconds the agents may take to be ready (rebuild
    included) before the launch counts as failed; protect_lag: a bound in steps on how far the newest protected
    snapshot may trail the newest staged one: the agents raise their CPU cap (from the profile's) while it is
    exceeded and report the cap it took (`hpcft status`), warning when even 1 core cannot meet it; persist_dir: the
    durable tier's directory on a file system every node and the next allocation see (default
    `<job_dir>/checkpoints`; `none`: no flushing); persist_every: flush once the newest protected step is this many
    steps past the newest durable one (and always before a requeue); persist_keep: durable checkpoints kept;
    persist_rate: bytes/s cap on each node's flush writes; persist_local: the durable tier's node-local first level,
    written first and drained to persist_dir (exported as $HPCFT_PERSIST_LOCAL; `$VAR`s expanded on each node;
    default: $HPCFT_NVME/hpcft-persist where `hpcft submit --nvme` gave one; `none`: off); agent_iface: the network interface the node agents bind to
    (default: the profile's, hsn0 on Frontier; a node without it falls back to its hostname's address with a
    warning event); agent_transport: tcp | mpi, what carries the node agents' bulk data and agreements (mpi: an mpi4py
    communicator over the site's MPI, the agents' srun step started with --mpi=`agent_mpi`; the heartbeats stay on
    TCP; hpcft/agent/transport/mpimesh.py); agent_mpi: the srun MPI plugin of the agents' step with mpi (default: the
    profile's, pmix, cray_shasta on Frontier); keep: the Checkpointer's `keep` (versions kept per rank), for memory planning; state_bytes: one
    snapshot's bytes on one node (all its ranks), for the memory check before the first launch (unknown: checked
    after the first snapshot only); node_memory: bytes of memory per node to plan with (default: what the batch
    host's /dev/shm and MemAvailable offer); memory_headroom: fraction of that memory left to the trainers and the
    system (hpcft/launch/config/memplan.py); elastic: when a node is lost and no spare is left, continue on fewer nodes
    (the state resharded from the survivors' memory plus parity, hpcft/launch/reshape.py) instead of requeueing;
    min_nodes: an elastic job shrinks down to this many active nodes; a loss below it requeues as any other (default 1);
    elastic_batch: keep-global (the global batch stays, each replica accumulates more micro-batches) or keep-per-rank
    (each replica's batch stays, the global batch shrinks), exported to the trainers as HPCFT_ELASTIC_BATCH;
    elastic_grow: a job running shrunk grows back toward `nodes` when nodes of its allocation return to service
    (hpcft/launch/watch/grow.py, the decision in hpcft/launch/policy/grow.py); grow_settle: seconds a returned node must
    stay healthy before the job takes it back (doubled for each earlier loss of that node); grow_every: at most one
    grow per this many seconds after the last shrink or grow; grow_max_losses: a node lost more often than this in
    the run is not taken back; standby: a warm standby process on every node of the slots and spares, which has
    imported `preload` and runs each trainer task's `python SCRIPT` / `python -m MODULE` in a forked child, so that a
    relaunch starts no interpreter (hpcft/launch/node/standby.py; other commands run cold, said in an event); preload:
    the comma-separated modules the standbys import (default: torch and what its first optimizer and
    use_deterministic_algorithms import, torch._dynamo included, numpy and hpcft's training side; add the training
    script's own heavy modules); stage_env: pack the interpreter's environment (its venv or conda env) once, broadcast
    it with sbcast to node-local storage and start every step from each node's copy (hpcft/launch/steps/stage.py; default:
    on in the frontier profile where the job has node-local NVMe, else off); stage_dir: that node-local directory,
    the same path on every node (default $HPCFT_NVME, else /tmp); stage_cache: where the archives are kept between
    launches and requeues, named by their content (default `<job_dir>/stage`; a directory shared by several jobs
    reuses one archive for all).
    copy: the CPU snapshot/restore copy method for every trainer, exported as HPCFT_COPY
    (default `auto`: measured once per host and cached; `default`: hpcft's built-in method; or pinned, e.g.
    `stream,threads=2,chunk=1M` — hpcft/snapshot/calibration).
    adopt: a job whose in-memory snapshots the trainers' restore and the agents' rebuild take besides this job's own
    (another job's are refused: hpcft/store/owner.py), exported as HPCFT_ADOPT.
    lost_progress_exit: the exit status of a run that finished but lost progress on the way (resumed from an older
    step than its trainers had reached, or from step 0), so that it cannot pass for a clean success (0: exit 0).
    """

    nodes: int | None = None
    spares: int = 0
    profile: str = "cpu"
    tasks_per_node: int | None = None
    max_restarts: int = 3
    hang_timeout: float = 0.0
    start_timeout: float = 0.0
    poll_interval: float = 1.0
    kill_grace: float = 10.0
    requeue_margin: float = 300.0
    requeue: bool = True
    job_dir: str | None = None
    srun_args: str = ""
    probe_timeout: float = 15.0
    loss_timeout: float = LOSS_TIMEOUT_S
    protect: str = "auto"
    group: int = 4
    losses: int = 1
    distance: int = 1
    protect_rate: float | None = None
    protect_timeout: float = 300.0
    protect_lag: int | None = None
    persist_dir: str | None = None
    persist_every: int = 100
    persist_keep: int = 2
    persist_rate: float | None = None
    persist_local: str | None = None
    agent_iface: str | None = None
    agent_transport: str = "tcp"
    agent_mpi: str | None = None
    keep: int = 2
    state_bytes: int | None = None
    node_memory: int | None = None
    memory_headroom: float = 0.2
    elastic: bool = False
    min_nodes: int | None = None
    elastic_batch: str = KEEP_GLOBAL
    elastic_grow: bool = False
    grow_settle: float = 60.0
    grow_every: float = 300.0
    grow_max_losses: int = 2
    straggler_factor: float = 1.5
    straggler_window: float = 30.0
    evict_stragglers: bool = False
    standby: bool = True
    preload: str = DEFAULT_PRELOAD
    stage_env: bool | None = None
    stage_dir: str | None = None
    stage_cache: str | None = None
    copy: str | None = None
    adopt: str | None = None
    lost_progress_exit: int = LOST_PROGRESS_EXIT

    @property
    def protected(self) -> bool:
        """Whether the node agents protect snapshots across nodes."""
        return self.protect != "none"

    @property
    def persisting(self) -> bool:
        """Whether the node agents flush to the durable tier (on unless persist_dir is `none`)."""
        return (self.persist_dir or "").lower() != "none"

    @property
    def with_agents(self) -> bool:
        """Whether node agents run next to the trainers: to protect, to flush, or both."""
        return self.protected or self.persisting


PROTECT_SCHEMES = ("auto", "none", "partner", "xor", "rs")
AGENT_TRANSPORTS = ("tcp", "mpi")
ELASTIC_BATCH = (KEEP_GLOBAL, KEEP_PER_RANK)
KEYS = tuple(f.name for f in fields(RunConfig))
_TYPES = {f.name: f.type for f in fields(RunConfig)}


def env_name(key: str) -> str:
    return "HPCFT_" + key.upper()


SIZE_KEYS = ("state_bytes", "node_memory")  # bytes, also written as 64G, 1.5TiB


def _coerce(key: str, value: Any, where: str) -> Any:
    kind = _TYPES[key]
    if value is None:
        return None
    try:
        if key in SIZE_KEYS:
            return parse_bytes(value)
        if kind in (int, "int", int | None, "int | None"):
            if isinstance(value, bool):
                raise ValueError
            return int(value)
        if kind in (float, "float", float | None, "float | None"):
            return float(value)
        if kind in (bool, "bool", bool | None, "bool | None"):
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError
        return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {key}={value!r} is not a valid {getattr(kind, '__name__', kind)}") from None


def _check_keys(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    out = {}
    for raw, value in data.items():
        key = raw.replace("-", "_")
        if key not in KEYS:
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
    """Options from a TOML file: top-level keys, or a [run] table."""
    p = Path(path)
    data = read_toml(p)
    data.pop("site", None)  # the sbatch script's site settings (hpcft/launch/config/site.py)
    if isinstance(data.get("run"), dict):
        data = data["run"]
    return _check_keys(data, f"config file {p}")


def from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """Options set as HPCFT_<NAME> (e.g. HPCFT_SPARES=2); only these names are read."""
    return {k: _coerce(k, environ[env_name(k)], f"environment variable {env_name(k)}")
            for k in KEYS if environ.get(env_name(k), "") != ""}


def load(cli: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None,
         config_file: str | os.PathLike | None = None) -> RunConfig:
    """Merge defaults < file (`config_file` or $HPCFT_CONFIG) < environment < CLI (None means not given)."""
    env = os.environ if environ is None else environ
    merged: dict[str, Any] = {}
    path = config_file or env.get(CONFIG_ENV)
    if path:
        merged.update(from_file(path))
    merged.update(from_env(env))
    merged.update(_check_keys({k: v for k, v in (cli or {}).items() if v is not None}, "command line"))
    cfg = replace(RunConfig(), **merged)
    validate(cfg)
    return cfg


def validate(cfg: RunConfig) -> None:
    """Reject values no run can use, naming the option."""
    if cfg.spares < 0:
        raise ConfigError(f"spares must be 0 or more (got {cfg.spares})")
    if cfg.nodes is not None and cfg.nodes < 1:
        raise ConfigError(f"nodes must be at least 1 (got {cfg.nodes})")
    if cfg.tasks_per_node is not None and cfg.tasks_per_node < 1:
        raise ConfigError(f"tasks_per_node must be at least 1 (got {cfg.tasks_per_node})")
    if cfg.max_restarts < 0:
        raise ConfigError(f"max_restarts must be 0 or more (got {cfg.max_restarts})")
    for key in ("hang_timeout", "start_timeout", "kill_grace", "requeue_margin", "protect_timeout", "grow_settle",
                "grow_every", "grow_max_losses", "loss_timeout", "straggler_factor"):
        if getattr(cfg, key) < 0:
            raise ConfigError(f"{key} must be 0 or more (got {getattr(cfg, key)})")
    if cfg.keep < 1:
        raise ConfigError(f"keep must be at least 1 (got {cfg.keep})")
    for key in ("state_bytes", "node_memory"):
        if getattr(cfg, key) is not None and getattr(cfg, key) <= 0:
            raise ConfigError(f"{key} must be a positive number of bytes (got {getattr(cfg, key)})")
    if not 0 <= cfg.memory_headroom < 1:
        raise ConfigError(f"memory_headroom must be a fraction in [0, 1) (got {cfg.memory_headroom})")
    if cfg.poll_interval <= 0 or cfg.probe_timeout <= 0:
        raise ConfigError("poll_interval and probe_timeout must be positive")
    from hpcft.launch.config import profiles

    profiles.get(cfg.profile)
    if cfg.protect not in PROTECT_SCHEMES:
        raise ConfigError(f"protect={cfg.protect!r} is not a protection scheme; choose one of {', '.join(PROTECT_SCHEMES)}")
    if cfg.agent_transport not in AGENT_TRANSPORTS:
        raise ConfigError(f"agent_transport={cfg.agent_transport!r} is not a transport; choose one of "
                          f"{', '.join(AGENT_TRANSPORTS)}")
    if cfg.agent_mpi is not None and not cfg.agent_mpi.replace("_", "").isalnum():
        raise ConfigError(f"agent_mpi={cfg.agent_mpi!r} is not an srun MPI plugin name (srun --mpi=list shows "
                          "them: pmix, pmi2, cray_shasta, ...)")
    for key in ("protect_rate", "persist_rate"):
        if getattr(cfg, key) is not None and getattr(cfg, key) <= 0:
            raise ConfigError(f"{key} must be positive bytes/s (got {getattr(cfg, key)})")
    if cfg.protect_lag is not None and cfg.protect_lag < 1:
        raise ConfigError(f"protect_lag must be at least 1 step (got {cfg.protect_lag})")
    if cfg.lost_progress_exit in OWN_EXITS or not 0 <= cfg.lost_progress_exit < 126:
        raise ConfigError(f"lost_progress_exit must be 0 (off) or an exit status from 6 to 125: 1-5 are hpcft run's "
                          f"other statuses, 126 and up the shell's and signals' (got {cfg.lost_progress_exit})")
    if cfg.persist_every < 1 or cfg.persist_keep < 1:
        raise ConfigError(f"persist_every and persist_keep must be at least 1 (got {cfg.persist_every}, "
                          f"{cfg.persist_keep})")
    _validate_elastic(cfg)
    _validate_stragglers(cfg)
    bad = [m for m in cfg.preload.split(",") if m.strip() and not all(p.isidentifier() for p in m.strip().split("."))]
    if bad:
        raise ConfigError(f"preload: {', '.join(map(repr, bad))} is not a module name; give dotted names separated "
                          "by commas, e.g. --preload torch,transformers")
    if cfg.protected and cfg.protect != "auto":
        scheme(cfg)  # the agents' own checks (group, losses, distance), before anything is launched
    if cfg.copy and cfg.copy.strip().lower() not in ("auto", "default"):
        parse_override(cfg.copy, default_choice(1, "fused"))  # the trainers' own parse, before anything is launched


def _validate_elastic(cfg: RunConfig) -> None:
    """--elastic needs what a shrink rebuilds and writes from: protection across nodes and a durable tier."""
    if cfg.elastic_batch not in ELASTIC_BATCH:
        raise ConfigError(f"elastic_batch={cfg.elastic_batch!r} is not a batch policy; choose one of "
                          f"{', '.join(ELASTIC_BATCH)}")
    if cfg.min_nodes is not None and cfg.min_nodes < 1:
        raise ConfigError(f"min_nodes must be at least 1 (got {cfg.min_nodes})")
    if cfg.min_nodes is not None and cfg.nodes is not None and cfg.min_nodes > cfg.nodes:
        raise ConfigError(f"min_nodes {cfg.min_nodes} is more than nodes {cfg.nodes}: an elastic job shrinks from "
                          "--nodes down to --min-nodes; lower --min-nodes or raise --nodes")
    if not cfg.elastic:
        if cfg.min_nodes is not None:
            raise ConfigError("min_nodes is given without elastic: add --elastic, or drop --min-nodes")
        if cfg.elastic_grow:
            raise ConfigError("elastic_grow is given without elastic (only a job that shrank can grow back): add "
                              "--elastic, or drop --elastic-grow")
        return
    if not cfg.protected:
        raise ConfigError("elastic needs protection across nodes (a shrink rebuilds the lost node's snapshot from "
                          "parity): drop --protect none, or drop --elastic")
    if not cfg.persisting:
        raise ConfigError("elastic needs a durable tier (a shrink writes the protected step there and the smaller "
                          "job reshards from it): drop --persist-dir none, or drop --elastic")


def _validate_stragglers(cfg: RunConfig) -> None:
    """A straggler is judged against a factor above 1 over a positive window; an eviction resumes from protection."""
    if 0 < cfg.straggler_factor <= 1:
        raise ConfigError(f"straggler_factor must be above 1 (how many times slower than the peers; got "
                          f"{cfg.straggler_factor:g}), or 0 to turn the detection off")
    if cfg.straggler_window <= 0:
        raise ConfigError(f"straggler_window must be positive seconds (got {cfg.straggler_window:g})")
    if cfg.evict_stragglers and not cfg.protected:
        raise ConfigError("evict_stragglers needs protection across nodes (the spare rebuilds the evicted node's "
                          "snapshot from its peers): drop --protect none, or drop --evict-stragglers")
    if cfg.evict_stragglers and not cfg.straggler_factor:
        raise ConfigError("evict_stragglers is given with straggler_factor 0 (detection off): set a factor above 1, "
                          "or drop --evict-stragglers")


def resolve_protect(cfg: RunConfig, active: int) -> RunConfig:
    """`cfg` with protect=auto made concrete for `active` training nodes: the default protects wherever the
    allocation allows it — xor over sets of `group` (fewer when fewer nodes train) from 3 nodes on, a partner
    copy on 2, nothing on 1 (no other node to hold anything). Any other value is returned as given."""
    if cfg.protect != "auto":
        return cfg
    if active >= 3:
        return replace(cfg, protect="xor", group=min(cfg.group, active), losses=1)
    return replace(cfg, protect="partner" if active == 2 else "none", distance=1)


def copy_env(cfg: RunConfig) -> dict[str, str]:
    """What the run's options set for the trainers' store (else HPCFT_<NAME> passes through as is): the copy method
    (`copy`) and the job whose snapshots a restore adopts (`adopt`; the agents' rebuild reads it too)."""
    return {env_name(key): getattr(cfg, key) for key in ("copy", "adopt") if getattr(cfg, key)}


def durable_dir(cfg: RunConfig, job_dir: Path) -> Path | None:
    """The durable tier's directory: `persist_dir`, else `<job_dir>/checkpoints`; None when flushing is off."""
    if not cfg.persisting:
        return None
    return Path(cfg.persist_dir).resolve() if cfg.persist_dir else job_dir / "checkpoints"


def scheme(cfg: RunConfig):
    """The node agents' hpcft.agent.protection.placement.Scheme for `cfg.protect` (ConfigError naming a bad value)."""
    from hpcft.agent.protection.placement import Scheme

    return Scheme(cfg.protect, cfg.group, cfg.losses, cfg.distance)
