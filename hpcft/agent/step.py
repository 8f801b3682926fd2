"""The srun command line of the node agents' step (pure): one agent per active node, overlapping the
trainers' step; each agent finds its slot from its settings' layout and SLURMD_NODENAME."""
from __future__ import annotations

from collections.abc import Sequence

from hpcft.agent.settings import AgentConfig
from hpcft.slurm.nodelist import compress

AGENT_STEP_NAME = "hpcft-agent"


def agent_argv(nodes: Sequence[str], settings: AgentConfig, *, python: str, rebuild: bool = False,
               mpi: str | None = None, wrap: Sequence[str] = (), cpus: int | None = None) -> list[str]:
    """`srun --overlap … python -m hpcft.agent --settings JSON` on `nodes` (the active slots, in slot order), the
    launch's settings on the command line: no file a full job directory could refuse. `mpi`: the srun MPI plugin
    (pmix, cray_shasta, …) for the mpi transport. `wrap`: what runs the agent's command (a warm standby); not with
    `mpi`, whose agents are srun's tasks. `cpus`: the node's CPUs (SLURM_JOB_CPUS_PER_NODE), all of them asked for
    (--overlap: shared with the trainers) and none bound to: under task/cgroup a step's cpuset is what it was
    allocated, and task/affinity may bind a task that asks for one CPU to one (a site's autobind: a core a trainer
    computes on); the agent's budget is then a cap in cores over the node's, at a priority below the trainers'
    (docs/reference/protection.md, "The CPU budget")."""
    n = len(nodes)
    return ["srun", f"--job-name={AGENT_STEP_NAME}", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1",
            f"--nodelist={compress(list(nodes))}", "--overlap", "--export=ALL", "--kill-on-bad-exit=0",
            *([f"--cpus-per-task={cpus}", "--cpu-bind=none"] if cpus else []),
            *([f"--mpi={mpi}"] if mpi else []), *([] if mpi else wrap), python, "-m", "hpcft.agent",
            "--settings", settings.to_json(),
            *(["--rebuild"] if rebuild else [])]
