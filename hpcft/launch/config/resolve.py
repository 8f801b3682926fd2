"""The options made concrete for one job: `auto` protection and set sizes for the allocation's nodes, the checks
of its shape and directories before any step, and what the options export to the steps."""
import os
from pathlib import Path

from hpcft.errors import ConfigError
from hpcft.launch.config.detect import Devices, check_fits
from hpcft.launch.config.model import RunConfig, env_name
from hpcft.launch.config.sections import DEFAULT_GROUP

def resolve_protect(cfg: RunConfig, active: int) -> RunConfig:
    """`cfg` made concrete for `active` training nodes: auto protects wherever the allocation allows it (xor from 3
    nodes, a partner on 2, nothing on 1); xor and rs without --group take the largest set up to 4 that the nodes
    allow. A scheme the nodes cannot carry is a ConfigError saying what to change (`check_shape`)."""
    prot = cfg.protection
    if prot.protect == "auto":
        if active >= 3:
            return cfg.but(protect="xor", group=min(prot.group or DEFAULT_GROUP, active), losses=1)
        return cfg.but(protect="partner" if active == 2 else "none", distance=1)
    if prot.protect in ("xor", "rs") and prot.group is None:
        cfg = cfg.but(group=min(DEFAULT_GROUP, active))
    return cfg


def check_shape(cfg: RunConfig, allocated: int) -> RunConfig:
    """The configuration resolved for an allocation of `allocated` nodes, or ConfigError before anything is launched:
    nodes and spares that do not fit, a protection scheme the active nodes cannot carry, a floor above them."""
    launch = cfg.launch
    active = launch.nodes if launch.nodes is not None else allocated - launch.spares
    if active + launch.spares > allocated or active < 1:
        raise ConfigError(f"--nodes {active} and --spares {launch.spares} need {active + launch.spares} nodes; the "
                          f"allocation has {allocated}: lower --nodes or --spares, or allocate more nodes")
    if cfg.elastic.elastic and (cfg.elastic.min_nodes or 1) > active:
        raise ConfigError(f"--min-nodes {cfg.elastic.min_nodes} is more than the {active} active nodes: lower it")
    cfg = resolve_protect(cfg, active)
    if cfg.protection.protected:
        from hpcft.agent.protection.placement import plan

        plan(active, cfg.protection.scheme())  # the agents' own checks: group, losses, distance against the nodes
    return cfg


def check_node(cfg: RunConfig, found: Devices) -> None:
    """The profile fits the node `hpcft run` starts on (the allocation's first), unless --profile-check is off:
    ConfigError before anything is launched, naming the profile to choose (detect.check_fits)."""
    if cfg.launch.profile_check:
        check_fits(cfg.launch.profile, found)


def check_paths(cfg: RunConfig, job_dir: Path) -> None:
    """The run's shared directories exist or can be made and take files: refused now, not at a flush hours later."""
    for key, path in (("job_dir", job_dir), ("persist_dir", durable_dir(cfg, job_dir)),
                      ("broadcast_cache", cfg.broadcast.broadcast_cache)):
        if path is None:
            continue
        try:
            Path(path).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"{key} {path} cannot be made ({exc.strerror}): give --{key.replace('_', '-')} a "
                              "directory you can write on a file system every node sees") from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(f"{key} {path} is not writable by you: give --{key.replace('_', '-')} a directory you "
                              "can write")


def copy_env(cfg: RunConfig) -> dict[str, str]:
    """What the run's options set for the trainers' store (else HPCFT_<NAME> passes through as is): the copy method
    (`copy`) and the job whose snapshots a restore adopts (`adopt`; the agents' rebuild reads it too)."""
    return {env_name(key): getattr(cfg.launch, key) for key in ("copy", "adopt") if getattr(cfg.launch, key)}


def durable_dir(cfg: RunConfig, job_dir: Path) -> Path | None:
    """The durable tier's directory: `persist_dir`, else `<job_dir>/checkpoints`; None when flushing is off."""
    if not cfg.durable.persisting:
        return None
    return Path(cfg.durable.persist_dir).resolve() if cfg.durable.persist_dir else default_durable_dir(job_dir)


def default_durable_dir(job_dir: Path) -> Path:
    """The durable tier's directory of a run given no `persist_dir`."""
    return job_dir / "checkpoints"
