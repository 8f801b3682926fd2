"""What Slurm says about an allocation and its nodes, read fresh with scontrol each time (SLURM_JOB_NODELIST
goes stale when a node leaves a --no-kill job), and the requeue request. Every command goes through a Runner."""
import logging
import re
from dataclasses import dataclass
from datetime import datetime

from hpcft.errors import SlurmError
from hpcft.slurm.nodelist import expand
from hpcft.slurm.runner import Runner

_log = logging.getLogger(__name__)
BAD_STATE_WORDS = ("DOWN", "DRAIN", "NOT_RESPONDING", "FAIL", "POWER", "REBOOT")
_FIELD = re.compile(r"(?:^|\s)([A-Za-z/:]+)=(\S*)")
_TASK_ERROR = re.compile(r"^srun: error: (\S+): tasks? ([\d,\-]+): (.+)$")


def fields(line: str) -> dict[str, str]:
    """`Key=Value` pairs of one `scontrol show … -o` line (values without spaces, which is all we read)."""
    return dict(_FIELD.findall(line))


@dataclass(frozen=True)
class JobInfo:
    job_id: str
    nodes: list[str]
    end_time: float | None
    batch: bool
    requeue: bool
    restarts: int


def _time(text: str) -> float | None:
    if not text or text in ("Unknown", "None", "N/A"):
        return None
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def job_info(runner: Runner, job_id: str) -> JobInfo:
    """The allocation as slurmctld sees it now: nodes, end time, batch or interactive, requeue allowed."""
    line = runner.run(["scontrol", "show", "job", "-o", job_id]).stdout.strip().splitlines()
    if not line:
        raise SlurmError(f"scontrol knows no job {job_id}")
    f = fields(line[0])
    unlimited = f.get("TimeLimit", "") in ("UNLIMITED", "Partition_Limit")
    return JobInfo(job_id=job_id, nodes=expand(f.get("NodeList", "") if f.get("NodeList") != "(null)" else ""),
                   end_time=None if unlimited else _time(f.get("EndTime", "")), batch=f.get("BatchFlag") == "1",
                   requeue=f.get("Requeue") == "1", restarts=int(f.get("Restarts", "0") or 0))


def node_states(runner: Runner, nodes: list[str]) -> dict[str, str]:
    """{node: State} from `scontrol show node -o`, e.g. 'MIXED', 'IDLE+NOT_RESPONDING', 'DOWN+DRAIN'."""
    if not nodes:
        return {}
    out = runner.run(["scontrol", "show", "node", "-o", ",".join(nodes)], check=False).stdout
    states = {}
    for line in out.splitlines():
        f = fields(line)
        if "NodeName" in f:
            states[f["NodeName"]] = f.get("State", "UNKNOWN")
    return states


def is_bad(state: str) -> bool:
    """DOWN, DRAIN(ED/ING), NOT_RESPONDING, FAIL… (also Slurm's `*` suffix for not responding)."""
    upper = state.upper()
    return upper.endswith("*") or any(word in upper for word in BAD_STATE_WORDS)


def bad_nodes(runner: Runner, job_id: str, nodes: list[str]) -> dict[str, str]:
    """Which of `nodes` are unusable now, and why: a bad state, or no longer in the job's allocation."""
    try:
        in_job = set(job_info(runner, job_id).nodes)
    except SlurmError as exc:
        _log.warning("cannot read job %s: %s", job_id, exc)
        in_job = set(nodes)
    states = node_states(runner, nodes)
    found = {}
    for node in nodes:
        state = states.get(node, "UNKNOWN")
        if node not in in_job:
            found[node] = f"left the allocation (state {state})"
        elif is_bad(state):
            found[node] = state
    return found


def task_errors(stderr_lines: list[str]) -> list[str]:
    """srun's per-task failure lines ('n2: task 1: Exited with exit code 3'), in order."""
    return [f"{m.group(1)}: task {m.group(2)}: {m.group(3)}" for m in map(_TASK_ERROR.match, stderr_lines) if m]


def requeue(runner: Runner, job_id: str, exclude: list[str]) -> None:
    """Ask Slurm to requeue the job, then keep `exclude` out of its next allocation where Slurm allows it
    (slurmctld takes ExcNodeList only from a pending job, so after the requeue; the batch shell outlives
    the requeue's SIGTERM for KillWait seconds). A refused exclusion is logged: the supervisor's own
    state file still keeps those nodes out of the next run's slots."""
    runner.run(["scontrol", "requeue", job_id])
    if exclude:
        result = runner.run(["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={','.join(exclude)}"], check=False)
        if result.returncode != 0:
            _log.warning("could not exclude %s from job %s's next allocation: %s", exclude, job_id,
                         (result.stderr or result.stdout).strip())
