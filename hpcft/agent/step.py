"""The srun command line of the node agents' step (pure): one agent per active node, overlapping the
trainers' step; each agent finds its slot from its settings' layout and SLURMD_NODENAME."""
from __future__ import annotations

from collections.abc import Sequence

from hpcft.agent.settings import AgentConfig
from hpcft.slurm.nodelist import compress

AGENT_STEP_NAME = "hpcft-agent"


def agent_argv(nodes: Sequence[str], settings: AgentConfig, *, python: str, rebuild: bool = False,
               mpi: str | None = None, wrap: Sequence[str] = ()) -> list[str]:
    """`srun --overlap … python -m hpcft.agent --settings JSON` on `nodes` (the active slots, in slot order), the
    launch's settings on the command line: no file a full job directory could refuse. `mpi`: the srun MPI plugin
    (pmix, cray_shasta, …) for the mpi transport. `wrap`: what runs the agent's command (a warm standby); not with
    `mpi`, whose agents are srun's tasks."""
    n = len(nodes)
    return ["srun", f"--job-name={AGENT_STEP_NAME}", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1",
            f"--nodelist={compress(list(nodes))}", "--overlap", "--export=ALL", "--kill-on-bad-exit=0",
            *([f"--mpi={mpi}"] if mpi else []), *([] if mpi else wrap), python, "-m", "hpcft.agent",
            "--settings", settings.to_json(),
            *(["--rebuild"] if rebuild else [])]
