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

from hpcft.errors import ConfigError
from hpcft.launch.config.detect import Devices, detect
from hpcft.launch.config.memplan import parse_bytes
from hpcft.launch.config.sections import (BOUNDS, OWN_EXITS, Broadcast, Durable, Elastic, Launch, Memory, Protection,
                                          Recovery, Standby, Stragglers)

CONFIG_ENV = "HPCFT_CONFIG"


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
