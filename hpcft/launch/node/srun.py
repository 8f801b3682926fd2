"""The srun command lines hpcft starts and the variables each trainer task gets: pure functions of the layout."""
import shlex
from collections.abc import Mapping, Sequence

from hpcft.env import PORT_BASE, PORT_SPAN, port_for_job
from hpcft.errors import ConfigError
from hpcft.launch.policy.layout import Layout
from hpcft.launch.config.profiles import Profile
from hpcft.slurm.nodelist import compress

TASK_WRAPPER = ("-m", "hpcft.launch.node.task", "--")
TRAIN_STEP_NAME = "hpcft-train"


def master_port(job_id: str, restart_count: int) -> int:
    """The job's rendezvous port, one further per relaunch: a new step never waits for the old master's socket."""
    return PORT_BASE + (port_for_job(job_id) - PORT_BASE + restart_count) % PORT_SPAN


def trainer_argv(layout: Layout, profile: Profile, command: Sequence[str], *, python: str,
                 extra: str = "") -> list[str]:
    """`srun … python -m hpcft.launch.node.task -- CMD` on the active slots' nodes, T tasks each, killed whole when a
    task fails, then the profile's and the user's options. --overlap: a step that failed with a node holds the healthy
    nodes' resources until Slurm marks the dead one DOWN, and the relaunch would wait ("Requested nodes are busy")."""
    if not command:
        raise ConfigError("no training command given: use `hpcft run [options] -- CMD ...`")
    n, t = len(layout.slots), layout.tasks_per_node
    return ["srun", f"--job-name={TRAIN_STEP_NAME}", f"--nodes={n}", f"--ntasks={n * t}",
            f"--ntasks-per-node={t}", f"--nodelist={compress(list(layout.slots))}", "--kill-on-bad-exit=1",
            "--overlap", "--export=ALL", *profile.srun_args, *shlex.split(extra), python, *TASK_WRAPPER, *command]


def probe_argv(nodes: Sequence[str]) -> list[str]:
    """A one-task-per-node step that prints each node's name: who answers is alive. --overlap so that it
    runs next to a step still holding the nodes' resources; --verbose so that srun says when it sends the nodes
    their tasks (a slow controller is not a slow node: hpcft/launch/node/nodecheck.py)."""
    return ["srun", "--verbose", "--job-name=hpcft-probe", f"--nodes={len(nodes)}", f"--ntasks={len(nodes)}",
            "--ntasks-per-node=1", f"--nodelist={compress(list(nodes))}", "--overlap", "--export=ALL",
            "printenv", "SLURMD_NODENAME"]


def step_env(layout: Layout, *, job_id: str, restart_count: int, job_dir: str,
             profile_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """What the supervisor exports to the trainer step; each task adds its own ranks (see `task_env`)."""
    return {**(profile_env or {}), **layout.to_env(), "HPCFT_JOB_ID": job_id,
            "HPCFT_NODELIST": compress(list(layout.slots)), "HPCFT_RESTART_COUNT": str(restart_count),
            "HPCFT_JOB_DIR": job_dir, "HPCFT_EVENT_DIR": job_dir, "MASTER_ADDR": layout.master,
            "MASTER_PORT": str(master_port(job_id, restart_count)), "WORLD_SIZE": str(layout.world_size),
            "HPCFT_WORLD_SIZE": str(layout.world_size), "LOCAL_WORLD_SIZE": str(layout.tasks_per_node),
            "HPCFT_LOCAL_WORLD_SIZE": str(layout.tasks_per_node)}


def task_env(environ: Mapping[str, str]) -> dict[str, str]:
    """One task's rank variables: srun numbers tasks in its node order, hpcft by slot, so RANK comes from the slot."""
    layout = Layout.from_env(dict(environ))
    node = environ.get("SLURMD_NODENAME")
    if not node:
        raise ConfigError("SLURMD_NODENAME is not set: the task wrapper must run inside an srun step")
    try:
        local = int(environ.get("SLURM_LOCALID", ""))
    except ValueError:
        raise ConfigError(f"SLURM_LOCALID={environ.get('SLURM_LOCALID')!r} is not an integer") from None
    rank = layout.rank(node, local)
    slot = layout.slot_of(node)
    values = {"RANK": rank, "LOCAL_RANK": local, "GROUP_RANK": slot, "HPCFT_RANK": rank, "HPCFT_LOCAL_RANK": local,
              "HPCFT_NODE_RANK": slot, "HPCFT_NODE_NAME": node}
    return {k: str(v) for k, v in values.items()}
