"""What Slurm says about an allocation and its nodes, read fresh with scontrol each time (SLURM_JOB_NODELIST
goes stale when a node leaves a --no-kill job), and the requeue request. Every command goes through a Runner."""
import contextlib
import logging
import re
import signal
import subprocess
import tempfile
from dataclasses import dataclass, field
from datetime import datetime

from hpcft.errors import ConfigError, SlurmError
from hpcft.slurm.nodelist import compress, expand, expand_range
from hpcft.slurm.runner import Runner

_log = logging.getLogger(__name__)
UPDATE_ANSWER_S = 1.0  # how long a requeue waits for slurmctld to answer its update (see `requeue`)
# When a requeued job may start again. Slurm holds it for the credential's lifetime from the end of its last run
# (cred_expire, 120 s by default; SchedulerParameters=requeue_delay from 25.11, none for an expedited requeue), which
# only makes the new launch credential's time stamp later than the old one's revocation (slurmctld's job_mgr.c), and
# keeps a begin time set before that end if it is still ahead: hpcft sets one that far ahead.
RESTART_AFTER_S = 5
# A node's state words (`scontrol show node`: 'MIXED+DRAIN', 'IDLE+POWERED_DOWN'; sinfo's suffixes too). Lost: it
# cannot run the job's tasks now. Closed: it runs them, but Slurm gives it no new work (an admin's drain, a health
# check's, `scontrol reboot ASAP`, a requested power-down): the running steps go on, the next allocation leaves it.
LOST_STATE_WORDS = ("DOWN", "NOT_RESPONDING", "POWERED_DOWN", "POWERING_DOWN", "POWER_UP", "POWERING_UP",
                    "REBOOT_ISSUED", "FUTURE")
CLOSED_STATE_PREFIXES = ("DRAIN", "FAIL", "REBOOT", "POWER_DOWN", "INVALID_REG", "ERROR")  # DRAINING, FAILING…
LOST_SUFFIXES = "*~%#^"  # sinfo: not responding, powered down, powering down, powering up, reboot issued
CLOSED_SUFFIXES = "@!"  # sinfo: reboot pending, power-down pending
_FIELD = re.compile(r"(?:^|\s)([A-Za-z/:]+)=(\S*)")
_TASK_ERROR = re.compile(r"^srun: error: (\S+): tasks? ([\d,\-]+): (.+)$")
_STEP_REFUSED = re.compile(r"^srun: error: Unable to create step for job \S+: (.+)$")
# `srun --verbose`, once the controller created the step and srun sends its tasks to a node (20.11+: 'launching
# StepId=7.3 on host n2, 1 tasks: 0'; older: 'launching 7.3 on host n2, …')
_LAUNCHING = re.compile(r"^srun: (?:\S+: )*launching (?:StepId=)?\S+ on host (\S+?),", re.MULTILINE)
# step-creation refusals that another try may not meet (the controller or the nodes, not the step's options)
TRANSIENT_REFUSALS = ("timed out", "not responding", "try again", "unable to contact", "required node not available",
                      "busy", "completing", "communication", "socket")


def fields(line: str) -> dict[str, str]:
    """`Key=Value` pairs of one `scontrol show … -o` line (values without spaces, which is all we read)."""
    return dict(_FIELD.findall(line))


@dataclass(frozen=True)
class JobInfo:
    job_id: str
    nodes: list[str]
    end_time: float | None
    batch: bool  # a batch job (BatchFlag 1, or 2 once Slurm requeued it after a node failure), not an salloc
    requeue: bool
    restarts: int
    batch_host: str = ""  # the node running the batch script (`hpcft run` under sbatch)
    num_nodes: int = 0  # nodes it asks for (the least of a range)
    partitions: tuple[str, ...] = ()
    reservation: str = ""
    exc_nodes: tuple[str, ...] = ()  # its ExcNodeList (the user's --exclude, an earlier requeue's)


def _nodes(hostlist: str) -> list[str]:
    return expand(hostlist if hostlist not in ("(null)", "") else "")


def _time(text: str) -> float | None:
    if not text or text in ("Unknown", "None", "N/A"):
        return None
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def _batch(flag: str) -> bool:
    """BatchFlag: 0 for an allocation (salloc), 1 for a batch job, 2 for one Slurm requeued itself after a node
    failure or a batch host that came back without its script (job_complete: "only one retry")."""
    return flag.isdigit() and int(flag) > 0


def job_info(runner: Runner, job_id: str) -> JobInfo:
    """The allocation as slurmctld sees it now: nodes, end time, batch or interactive, requeue allowed."""
    line = runner.run(["scontrol", "show", "job", "-o", job_id]).stdout.strip().splitlines()
    if not line:
        raise SlurmError(f"scontrol knows no job {job_id}")
    f = fields(line[0])
    unlimited = f.get("TimeLimit", "") in ("UNLIMITED", "Partition_Limit")
    return JobInfo(job_id=job_id, nodes=_nodes(f.get("NodeList", "")),
                   end_time=None if unlimited else _time(f.get("EndTime", "")), batch=_batch(f.get("BatchFlag", "")),
                   requeue=f.get("Requeue") == "1", restarts=int(f.get("Restarts", "0") or 0),
                   batch_host=f.get("BatchHost", "") if f.get("BatchHost") != "(null)" else "",
                   num_nodes=int(re.match(r"\d*", f.get("NumNodes", "")).group() or 0),
                   partitions=tuple(p for p in f.get("Partition", "").split(",") if p),
                   reservation=f.get("Reservation", "") if f.get("Reservation") != "(null)" else "",
                   exc_nodes=tuple(_nodes(f.get("ExcNodeList", ""))))


def job_ended(runner: Runner, job_id: str) -> bool:
    """True once the job has ended for good: not pending, running or requeued (or gone from slurmctld)."""
    line = runner.run(["scontrol", "show", "job", "-o", job_id], check=False).stdout
    return fields(line).get("JobState", "GONE") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                                                     "OUT_OF_MEMORY", "GONE")


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


def _words(state: str) -> list[str]:
    return [w.rstrip("*~%#^!$@") for w in state.upper().split("+")]


def is_lost(state: str) -> bool:
    """The node cannot run the job's tasks now: DOWN, NOT_RESPONDING (sinfo's `*`), powered down, booting, rebooting."""
    return any(c in state for c in LOST_SUFFIXES) or any(w in LOST_STATE_WORDS for w in _words(state))


def is_closed(state: str) -> bool:
    """Slurm gives the node no new work, though what runs there goes on: drained, failing, reboot or power-down due."""
    return any(c in state for c in CLOSED_SUFFIXES) or any(w.startswith(CLOSED_STATE_PREFIXES) for w in _words(state))


def is_bad(state: str) -> bool:
    """Not a node to start new work on: lost or closed."""
    return is_lost(state) or is_closed(state)


@dataclass(frozen=True)
class Health:
    """Slurm on some of a job's nodes: {node: why} of the lost (or out of the allocation) and the closed (alive)."""
    lost: dict[str, str]
    closed: dict[str, str]

    @property
    def bad(self) -> dict[str, str]:
        return {**self.lost, **self.closed}


def node_health(runner: Runner, job_id: str, nodes: list[str], *, allocation: bool = True) -> Health:
    """Slurm's view of `nodes` of job `job_id`, read fresh: `scontrol show node`, and with `allocation` `scontrol show
    job` too (a node out of the allocation is lost; without, half the RPCs: a node leaves a job only once Slurm marks
    it)."""
    in_job = set(nodes)
    try:
        in_job = set(job_info(runner, job_id).nodes) if allocation else in_job
    except SlurmError as exc:
        _log.warning("cannot read job %s: %s", job_id, exc)
    states = node_states(runner, nodes)
    lost, closed = {}, {}
    for node in nodes:
        state = states.get(node, "UNKNOWN")
        if node not in in_job:
            lost[node] = f"left the allocation (state {state})"
        elif is_lost(state):
            lost[node] = state
        elif is_closed(state):
            closed[node] = state
    return Health(lost, closed)


def bad_nodes(runner: Runner, job_id: str, nodes: list[str]) -> dict[str, str]:
    """Which of `nodes` are unusable for new work now, and why: lost or closed (node_health)."""
    return node_health(runner, job_id, nodes).bad


def task_errors(stderr_lines: list[str]) -> list[str]:
    """srun's per-task failure lines ('n2: task 1: Exited with exit code 3'), in order."""
    return [f"{m.group(1)}: task {m.group(2)}: {m.group(3)}" for m in map(_TASK_ERROR.match, stderr_lines) if m]


def ended_tasks(stderr_lines: list[str]) -> dict[str, int]:
    """{node: its tasks srun has reported ended} ('n2: tasks 4-7: Terminated' counts 4; an exit 0 gets no line)."""
    ended: dict[str, set[int]] = {}
    for m in map(_TASK_ERROR.match, stderr_lines):
        if m:
            with contextlib.suppress(ConfigError):  # not a task list after all: no task of it counted
                ended.setdefault(m.group(1), set()).update(map(int, expand_range(m.group(2), m.group(0))))
    return {node: len(tasks) for node, tasks in ended.items()}


def launched_on(verbose_stderr: str) -> set[str]:
    """The nodes `srun --verbose` says it sent the step's tasks to: the step exists, the rest is up to those nodes."""
    return set(_LAUNCHING.findall(verbose_stderr))


def step_refusal(stderr_lines: list[str]) -> str | None:
    """Slurm's reason when srun could not create the step because of its options ('More processors requested
    than permitted'), or None: no refusal, or one another try may not meet (TRANSIENT_REFUSALS)."""
    for m in map(_STEP_REFUSED.match, stderr_lines):
        if m and not any(word in m.group(1).lower() for word in TRANSIENT_REFUSALS):
            return m.group(1).strip()
    return None


def _ignore_sigterm() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # kept across exec: the command outlives the requeue's SIGTERM


def _unkillable(runner: Runner, argv: list[str], wait: float | None = None, **kw) -> tuple[int | None, str]:
    """Run a Slurm command with SIGTERM ignored: (exit status, output); with `wait`, (None, "") when it has not
    answered within that many seconds (it is left running: its request is with slurmctld)."""
    proc = runner.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=_ignore_sigterm,
                        **kw)
    try:
        out, _ = proc.communicate(timeout=runner.timeout if wait is None else wait)
    except subprocess.TimeoutExpired:
        if wait is None:
            raise
        return None, ""
    return proc.returncode, (out or "").strip()


@dataclass(frozen=True)
class Placement:
    need: int          # nodes the job asks for (the least of a range)
    pool: list[str]    # where it may be placed: its reservation's nodes, else its partitions'
    excluded: list[str]  # its ExcNodeList now (the user's --exclude, an earlier requeue's)
    held: list[str] = field(default_factory=list)  # the nodes it holds now
    batch_host: str = ""  # where its batch script runs (Slurm never takes that node from the job)


def placement(runner: Runner, job_id: str) -> Placement:
    """Where Slurm may place the job's next allocation: its reservation's nodes, else its partitions'."""
    job = job_info(runner, job_id)
    sources = [["scontrol", "show", "reservation", "-o", job.reservation]] if job.reservation else \
        [["scontrol", "show", "partition", "-o", p] for p in job.partitions]
    pool: list[str] = []
    for argv in sources:
        pool += [n for n in _nodes(fields(runner.run(argv, check=False).stdout).get("Nodes", "")) if n not in pool]
    return Placement(job.num_nodes, pool, list(job.exc_nodes), job.nodes, job.batch_host if job.batch else "")


def affordable(exclude: list[str], states: dict[str, str], where: Placement) -> list[str]:
    """Those of `exclude` (found bad by hpcft, healthy by Slurm) that can be kept out of the job's next allocation
    and still leave it `where.need` nodes in service: the rest stay allowed, or the job could never start again
    (a partition or reservation of about its size). All of them when the pool is unknown."""
    if not where.pool or where.need <= 0:
        return list(exclude)
    usable = [n for n in where.pool if not is_bad(states.get(n, "UNKNOWN")) and n not in where.excluded]
    return [n for n in exclude if n in usable][:max(0, len(usable) - where.need)]


@dataclass(frozen=True)
class Requeued:
    excluded: list[str]  # what hpcft put into the job's ExcNodeList
    allowed: list[str]   # found bad by hpcft but left allowed: without them too few nodes are left in service
    reported: dict[str, str] = field(default_factory=dict)  # {node found bad by hpcft: its state, as Slurm said}
    unexcluded: list[str] = field(default_factory=list)  # to be excluded, but `scontrol update` failed
    trusted: list[str] = field(default_factory=list)  # found bad in an earlier allocation: allowed again
    restart: str = ""  # when Slurm may start the job again, in words
    released: list[str] = field(default_factory=list)  # found bad and taken out of the job before the requeue

    def said(self) -> dict[str, str]:
        """The fields of the `requeued` event."""
        return {"slurm_excluded": ",".join(self.excluded), "allowed": ",".join(self.allowed),
                "released": ",".join(self.released), "restart": self.restart, "reason": self.reason()}

    def reason(self) -> str:
        """What became of each node found bad, in the words of what Slurm reported of it."""
        def named(nodes: list[str]) -> str:
            return ", ".join(f"{n} ({self.reported.get(n) or 'no state reported'})" for n in nodes)

        kept = set(self.excluded) | set(self.allowed) | set(self.unexcluded) | set(self.trusted)
        marked = [n for n, state in self.reported.items() if n not in kept and state]
        unknown = [n for n, state in self.reported.items() if n not in kept and not state]
        said = [f"{named(self.excluded)} put into ExcNodeList: found bad by hpcft, while Slurm took it for healthy"
                if self.excluded else "",
                f"{named(marked)} not put into ExcNodeList: Slurm itself reports it out of service and allocates "
                "it only once back" if marked else "",
                f"{named(unknown)} not put into ExcNodeList: Slurm reported nothing of it" if unknown else "",
                f"{named(self.allowed)} left allowed although found bad by hpcft: the job cannot start without it "
                "(too few nodes in service in its partition or reservation)" if self.allowed else "",
                f"{named(self.trusted)} allowed again: found bad in an earlier allocation, in service by Slurm since"
                if self.trusted else "",
                f"{named(self.unexcluded)} could not be put into ExcNodeList (scontrol update failed)"
                if self.unexcluded else "",
                f"{', '.join(self.released)} taken out of the job before the requeue: its end waits for no answer "
                "from them" if self.released else ""]
        return "; ".join(filter(None, said)) or "no node was found bad: nothing to keep out of the next allocation"


def requeue(runner: Runner, job_id: str, exclude: list[str], nodes: int = 0, ours: list[str] = ()) -> Requeued:
    """Requeue the job, keeping out of its next allocation those of `exclude` that it holds and Slurm deems healthy, as
    many as it can spare (`affordable`) with `nodes` (the allocation this run started with) still in service: Slurm
    removes a DOWN node from a --no-kill job for good, so its NumNodes then reads fewer than its tasks need, and
    excluding by that count left a requeued job never runnable. One found bad in an earlier allocation has been through
    Slurm's hands since (marked down and back, or kept out for one allocation): `ours`, what hpcft put into the job's
    ExcNodeList before, is lifted, the user's --exclude stays; else every node of a long job is out one day. The lost
    nodes it holds, but those left allowed, are taken out of the job first (`release`). Slurm takes ExcNodeList only
    from a pending job, so it is set after the requeue, in one update with the time the job may start again
    (RESTART_AFTER_S); the requeue's SIGTERM hits the whole batch step: both commands ignore SIGTERM and run within
    KillWait."""
    where = Placement(0, [], [])  # unknown: every suspect is kept out
    if exclude or ours:  # else nothing to keep out or lift: nothing to read
        try:
            where = placement(runner, job_id)  # all reads before the requeue's SIGTERM
        except SlurmError as exc:
            _log.warning("cannot read where job %s may be placed (%s): every suspect node is excluded", job_id, exc)
    before, users = where.excluded, [n for n in where.excluded if n not in ours]
    where = Placement(max(where.need, nodes) if where.pool else 0, where.pool, users, where.held, where.batch_host)
    states = node_states(runner, list(dict.fromkeys([*exclude, *where.pool]))) if exclude else {}
    healthy = [n for n in exclude if not is_bad(states.get(n, "DOWN"))]  # no state: not one to keep out by name
    trusted = [n for n in healthy if where.pool and n not in where.held]
    suspects = [n for n in healthy if n not in trusted]
    keep_out = affordable(suspects, states, where)
    allowed = [n for n in suspects if n not in keep_out]
    reported = {n: states.get(n, "") for n in exclude}
    released = release(runner, job_id, [n for n in exclude if n not in allowed], where, nodes)
    code, out = _unkillable(runner, ["scontrol", "requeue", job_id])
    if code != 0:
        raise SlurmError(f"'scontrol requeue {job_id}' failed with exit status {code}: {out[-2000:]}")
    merged = list(dict.fromkeys([*users, *keep_out]))
    changes = [f"ExcNodeList={','.join(merged)}"] if set(merged) != set(before) else []
    # slurmctld may answer an update of a job being requeued only once the job has ended, and its batch step is this
    # process: waiting for that answer held the requeue ~5 s, until Slurm killed the batch step (found by hpcft chaos)
    asked = [*changes, f"StartTime=now+{RESTART_AFTER_S}"]
    code, out = _unkillable(runner, ["scontrol", "update", f"JobId={job_id}", *asked], wait=UPDATE_ANSWER_S)
    restart = (f"{RESTART_AFTER_S} s after the requeue ({asked[-1]}) unless its last run ends later, not after "
               "Slurm's requeue hold")
    if code is None:
        _log.info("%s of job %s: asked; slurmctld applies it once the job has ended (and refuses it if the job is "
                  "still completing 5 s after the requeue)", " ".join(asked), job_id)
        restart = f"{asked[-1]} asked, not yet answered (refused: after Slurm's requeue hold)"
    elif code != 0:
        _log.warning("could not update job %s (%s, exit status %s): %s", job_id, " ".join(asked), code, out)
        restart = f"after Slurm's requeue hold: {asked[-1]} failed (exit status {code}: {out[-300:]})"
    made = code in (0, None) or not changes  # the job's ExcNodeList is what it was asked to be
    return Requeued(keep_out if made else [], allowed, reported, [] if made else keep_out, trusted, restart=restart,
                    released=released)


def release(runner: Runner, job_id: str, lost: list[str], where: Placement, nodes: int = 0) -> list[str]:
    """Take the nodes of `lost` that the job holds out of it (`scontrol update NodeList=` the rest: a job's owner may
    shrink it), before its requeue: the job's end otherwise waits for a dead node's answer until Slurm marks it down
    (SlurmdTimeout, minutes on a large machine), and Slurm's requeue hold after that end. Not a node left allowed: Slurm
    still takes it for healthy, and released it is allocated again at once, dead; one Slurm reports not responding it
    allocates no more, one in ExcNodeList the job will not get. Never the batch host (Slurm refuses it); the requeued
    job still asks for its node count. Not where Slurm would refuse it: a job whose batch host it has taken out (a lost
    batch host, marked down: every node list must still hold it), or a job already shrunk in this allocation (fewer
    nodes held than the `nodes` it started with) that slurmctld keeps no accounting record of (`keeps_accounts`).
    Refused (SchedulerParameters=disable_job_shrink): the requeue waits as before. What was taken out."""
    out = [n for n in lost if n in where.held and n != where.batch_host]
    keep = [n for n in where.held if n not in out]
    batch_host_gone = where.batch_host and where.batch_host not in where.held
    if not out or not keep or batch_host_gone or (len(where.held) < nodes and not keeps_accounts(runner)):
        return []
    with tempfile.TemporaryDirectory(prefix="hpcft-release-") as cwd:  # scontrol writes slurm_job_<id>_resize.*
        code, said = _unkillable(runner, ["scontrol", "update", f"JobId={job_id}", f"NodeList={compress(keep)}"],
                                 cwd=cwd)
    if code != 0:
        _log.warning("could not take %s out of job %s before its requeue (exit status %s): %s; its end waits for "
                     "Slurm to mark them down", ",".join(out), job_id, code, said[-300:])
        return []
    return out


def keeps_accounts(runner: Runner) -> bool:
    """Whether slurmctld keeps accounting records. After it resizes a job (a --no-kill job's node marked down, or a
    release) it refuses every update of that job until the record is written again: at once through slurmdbd, never
    with accounting_storage/none (until the job ends), and it retries for 5 s before saying so; a release of a job of
    fewer nodes than it started with would only cost those 5 s there."""
    said = runner.run(["scontrol", "show", "config"], check=False).stdout
    return not re.search(r"^AccountingStorageType\s*=\s*accounting_storage/none\s*$", said, re.M)


def complete(runner: Runner, job_id: str, exit_code: int) -> str:
    """End a batch job whose batch script died with its node, as that script's exit would (libslurm); failing that,
    cancel it (the job reads CANCELLED though hpcft run ended with `exit_code`). How it was ended."""
    from hpcft.slurm.libslurm import complete_job

    why = complete_job(job_id, exit_code)
    if why is None:
        return "slurm_complete_job"
    runner.run(["scancel", job_id], check=False)
    return f"scancel ({why})"
