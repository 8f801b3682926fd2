"""The srun command line of the node agents' step (pure): one agent per active node, overlapping the
trainers' step; each agent finds its slot from $HPCFT_LAYOUT and SLURMD_NODENAME (see `step_env`)."""
from __future__ import annotations

from collections.abc import Sequence

from hpcft.agent.protection.placement import Scheme
from hpcft.durable.settings import PersistConfig
from hpcft.slurm.nodelist import compress

AGENT_STEP_NAME = "hpcft-agent"


def agent_argv(nodes: Sequence[str], *, rendezvous: str, secret: str, scheme: Scheme, python: str,
               rebuild: bool = False, interval: float = 1.0, rate: float | None = None, rounds: int = 0,
               cpu_cores: float | None = None, persist: PersistConfig | None = None,
               lag_bound: int | None = None, iface: str | None = None,
               layout: Sequence[str] | None = None, loss_timeout: float | None = None,
               mpi: str | None = None, wrap: Sequence[str] = ()) -> list[str]:
    """`srun --overlap … python -m hpcft.agent …` on `nodes` (the active slots, in slot order). The supervisor
    exports HPCFT_LAYOUT, HPCFT_JOB_ID and HPCFT_RESTART_COUNT (the tag keeping relaunches apart) to it,
    passes `rebuild=True` after replacing nodes, and waits on `status.wait_ready` before the trainers. `layout`: the
    slots' nodes when the agents run on fewer (an elastic shrink: a lost slot's agent runs elsewhere, `--hosted`).
    `mpi`: the srun MPI plugin (pmix, cray_shasta, …) when the agents' mesh runs over MPI (--transport mpi).
    `wrap`: what runs the agent's command (hpcft.launch.node.handoff: a node's warm standby); not with `mpi`, whose
    agents are srun's own tasks (the MPI plugin's connection)."""
    n = len(nodes)
    argv = ["srun", f"--job-name={AGENT_STEP_NAME}", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1",
            f"--nodelist={compress(list(nodes))}", "--overlap", "--export=ALL", "--kill-on-bad-exit=0",
            *([f"--mpi={mpi}"] if mpi else []), *([] if mpi else wrap), python, "-m", "hpcft.agent",
            "--rendezvous", rendezvous, "--secret", secret, "--host", "auto",
            "--layout", ",".join(layout or nodes), "--scheme", scheme.name, "--group", str(scheme.group),
            "--losses", str(scheme.losses), "--distance", str(scheme.distance), "--rounds", str(rounds),
            "--interval", str(interval)]
    if rate:
        argv += ["--rate", str(rate)]
    if cpu_cores is not None:
        argv += ["--cpu-cores", str(cpu_cores)]
    if lag_bound:
        argv += ["--lag-bound", str(lag_bound)]
    if persist is not None and persist.root:
        argv += ["--persist-dir", persist.root, "--persist-every", str(persist.every), "--persist-keep",
                 str(persist.keep)]
        if persist.rate:
            argv += ["--persist-rate", str(persist.rate)]
    if iface:
        argv += ["--iface", iface]
    if loss_timeout is not None:
        argv += ["--loss-timeout", f"{loss_timeout:g}"]
    if mpi:
        argv += ["--transport", "mpi"]
    if rebuild:
        argv.append("--rebuild")
    return argv
