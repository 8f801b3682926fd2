"""What one launch's node agents are told, from the run's options and its profile: the interface they bind to, the
MPI plugin of their step, their CPU budget, and the whole AgentConfig."""
from __future__ import annotations

from pathlib import Path

from hpcft.agent.protection import budget
from hpcft.agent.settings import AgentConfig
from hpcft.agent.transport import secret as job_secret
from hpcft.durable.settings import PersistConfig
from hpcft.launch.config import profiles
from hpcft.launch.config.model import RunConfig
from hpcft.launch.config.resolve import durable_dir
from hpcft.launch.policy.layout import Layout


def agent_iface(cfg: RunConfig) -> str | None:
    """The interface the agents bind to: --agent-iface, else the profile's ('none': the hostname's address)."""
    name = cfg.protection.agent_iface or profiles.get(cfg.launch.profile).agent_iface
    return None if name == "none" else name


def agent_mpi(cfg: RunConfig) -> str | None:
    """The agents' srun MPI plugin with --agent-transport mpi (--agent-mpi, else the profile's); None with tcp."""
    if cfg.protection.agent_transport != "mpi":
        return None
    return cfg.protection.agent_mpi or profiles.get(cfg.launch.profile).agent_mpi


def agent_cores(cfg: RunConfig) -> float:
    """Each node's agent's CPU budget in cores: --agent-cores, else the profile's."""
    given = cfg.protection.agent_cores
    return profiles.get(cfg.launch.profile).agent_cpu_cores if given is None else given


def agent_settings(cfg: RunConfig, job_dir: Path, layout: Layout, mpi: str | None) -> AgentConfig:
    """What every agent of a launch on `layout` is told; `mpi`: their step's srun MPI plugin (None: TCP). The CPU
    budget as a cap in cores, which a lag bound (--protect-lag; 0: none) may raise to `budget.ceiling` of it."""
    root, dur, prot = durable_dir(cfg, job_dir), cfg.durable, cfg.protection
    cores = agent_cores(cfg)
    return AgentConfig(rendezvous=str(job_dir / "agents"), secret_file=str(job_dir / job_secret.NAME),
                       layout=layout.slots, host="auto", iface=agent_iface(cfg), scheme=cfg.protection.scheme(),
                       rate=prot.protect_rate, rounds=0, cpu_cores=cores, lag_bound=prot.protect_lag or None,
                       lag_cores=budget.ceiling(cores), loss_timeout=cfg.recovery.loss_timeout,
                       persist=PersistConfig(str(root), dur.persist_every, dur.persist_keep, dur.persist_rate)
                       if root else PersistConfig(), transport="mpi" if mpi else "tcp",
                       tasks_per_node=layout.tasks_per_node)
