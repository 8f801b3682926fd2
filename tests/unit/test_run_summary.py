"""What `hpcft run` says about a run and how it exits (issue 34, items 6 and 8), on a real Supervisor whose Slurm, srun
steps and trainers are fakes: each lost step counted once, from what the trainers had reached when their launch
failed; the summary's level and exit status of a run that lost progress; a requeued run after a lost batch host."""
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from hpcft import events
from hpcft.launch import losses
from hpcft.launch.config.model import RunConfig, make
from hpcft.launch.policy.layout import Layout
from hpcft.launch.policy.state import RunState
from hpcft.launch.policy.failures import EXIT_GAVE_UP, Action, Decision
from hpcft.launch.supervisor import Supervisor

NODES = ["n1", "n2", "n3"]
JOB = ("JobId=7 JobState=RUNNING Partition=batch NumNodes=2 ExcNodeList=(null) Reservation=(null) BatchFlag=1 "
       "Requeue=1 Restarts=0 NodeList=n[1-3]")


class _Slurm:
    """scontrol's answers as text, and srun steps as the processes `steps` makes: no cluster."""

    timeout = 10

    def __init__(self, states: dict[str, str] | None = None):
        self.states = states or {}
        self.steps: list = []  # per srun of the trainers: a callable run before the process starts, and its status

    def run(self, argv, check=True, **kw):
        words = " ".join(argv)
        out = ""
        if words.startswith("scontrol show job"):
            out = JOB
        elif words.startswith("scontrol show partition"):
            out = "PartitionName=batch Nodes=n[1-6] State=UP"
        elif words.startswith("scontrol show node"):
            out = "\n".join(f"NodeName={n} State={s}" for n, s in self.states.items())
        return subprocess.CompletedProcess(argv, 0, out, "")

    def popen(self, argv, **kw):
        code = 0
        if argv[0] == "srun" and self.steps:
            before, code = self.steps.pop(0)
            before()
        return subprocess.Popen([sys.executable, "-c", f"import sys; sys.exit({code})"], **kw)


def _supervisor(tmp_path, slurm: _Slurm, **options) -> Supervisor:
    cfg = make(job_dir=str(tmp_path / "job"), protect="none", persist_dir="none", standby=False,
                    poll_interval=0.05, **options)
    sup = Supervisor(cfg, ["python", "train.py"], runner=slurm, environ={"SLURM_JOB_ID": "7", "USER": "me",
                                                                        "PATH": "/usr/bin:/bin"})
    sup.preflight = SimpleNamespace(poll=lambda *a, **k: None)
    for part in (sup.broadcast, sup.janitor, sup.standbys):
        part.ensure = lambda *a, **k: None
    sup.standbys.wait = lambda *a, **k: None
    return sup


def _said(sup: Supervisor, kind: str) -> list[dict]:
    return [e for e in events.read(sup.job_dir) if e["event"] == kind]


def _report(sup: Supervisor, steps: dict[int, int]) -> None:
    """The nodes' progress reports: {rank: newest step in its store}."""
    sup.fabric.view.apply({"progress": {str(r): [s, None] for r, s in steps.items()}}, time.time())


def _restored(sup: Supervisor, world: int, step: int) -> None:
    for rank in range(world):
        if step:
            events.emit("restore_done", log_dir=sup.job_dir, rank=rank, step=step)
        else:
            events.emit("restore_none", log_dir=sup.job_dir, rank=rank)


def test_a_loss_counts_from_the_step_the_trainers_had_reached_not_from_what_the_rebuild_left(tmp_path):
    """The trainers reach step 12, a node is lost; the next launch's agents rebuild step 10 onto the spare and report
    its store (step 10) before the trainers start: the resume from step 10 lost 2 steps, whatever the reports said
    by then (before: the view read at the next launch, 0 or 2 steps lost depending on when the report came). A
    third launch that resumes where the second's trainers were (11) loses nothing: nothing is counted twice."""
    slurm = _Slurm()
    sup = _supervisor(tmp_path, slurm)
    first = Layout.plan(NODES, active=2, spares=1, tasks_per_node=2)
    world = first.world_size
    slurm.steps = [(lambda: (_restored(sup, world, 0), _report(sup, dict.fromkeys(range(world), 12))), 1),
                   (lambda: (_restored(sup, world, 10), _report(sup, dict.fromkeys(range(world), 11))), 1),
                   (lambda: _restored(sup, world, 11), 0)]
    sup.nodes.bad = lambda slots, **k: {"n2": "DOWN"}
    event = sup._launch(first, 0)
    assert event.bad_nodes == ("n2",) and sup.ledger.lost == []
    second = Layout.plan(NODES, active=2, spares=0, tasks_per_node=2, excluded=["n2"], previous=first.slots)
    # the agents of the next launch rebuilt step 10 onto the spare and report it before the trainers start
    sup.standbys.wait = lambda *a, **k: _report(sup, {2: 10, 3: 10})
    sup.nodes.bad = lambda slots, **k: {}
    sup._launch(second, 1)
    assert [(x.reached, x.resumed_from, x.steps_lost) for x in sup.ledger.lost] == [(12, 10, 2)]
    lost = [(e["reached"], e["resumed_from"], e["level"]) for e in _said(sup, "progress_lost")]
    assert lost == [(12, 10, "WARNING")]
    sup.standbys.wait = lambda *a, **k: None
    sup._launch(second, 2)
    assert len(sup.ledger.lost) == 1
    sup._finish(Decision(Action.DONE, "every task exited 0", second, 0), RunState())
    summary = _said(sup, "summary")[-1]
    assert summary["level"] == "WARNING" and summary["steps_lost"] == 2 and "2 step(s) lost" in summary["lost"]


@pytest.mark.parametrize("lost,option,action,code,expected", [
    ([losses.Loss(12, 0, "node n2 lost")], None, Action.DONE, 0, 6),      # the default: told apart from success
    ([losses.Loss(12, 10, "node n2 lost")], None, Action.DONE, 0, 6),     # a partial loss too
    ([losses.Loss(12, 0, "node n2 lost")], 0, Action.DONE, 0, 0),         # 0: off
    ([losses.Loss(12, 0, "node n2 lost")], 9, Action.DONE, 0, 9),
    ([], None, Action.DONE, 0, 0),                                        # nothing lost: success
    ([losses.Loss(12, 0, "node n2 lost")], None, Action.STOP, EXIT_GAVE_UP, EXIT_GAVE_UP),  # a failure stays one
])
def test_a_run_that_lost_progress_exits_with_lost_progress_exit(tmp_path, lost, option, action, code, expected):
    sup = _supervisor(tmp_path, _Slurm(), **({} if option is None else {"lost_progress_exit": option}))
    sup.ledger.lost = list(lost)
    layout = Layout.plan(NODES, active=2, spares=1)
    assert sup._finish(Decision(action, "why", layout, code), RunState()) == expected
    summary = _said(sup, "summary")[-1]
    assert summary["exit_code"] == expected
    assert summary["level"] == ("ERROR" if action is Action.STOP or any(x.resumed_from == 0 for x in lost)
                                else "WARNING" if lost else "INFO")


def test_lost_progress_exit_is_an_option_of_hpcft_run_that_cannot_pass_for_another_status(monkeypatch):
    from click.testing import CliRunner

    from hpcft.errors import ConfigError
    from hpcft.launch.config import model as config
    from hpcft.launch.cli import run

    assert config.make().recovery.lost_progress_exit == 6
    assert "--lost-progress-exit" in CliRunner().invoke(run, ["--help-all"]).output
    assert config.load({"lost_progress_exit": 0}, environ={}).recovery.lost_progress_exit == 0
    assert config.load({}, environ={"HPCFT_LOST_PROGRESS_EXIT": "42"}).recovery.lost_progress_exit == 42
    for taken in (1, 3, 4, 5, 143, 256, -1):  # hpcft's own statuses, a signal's, none at all
        with pytest.raises(ConfigError, match="lost_progress_exit"):
            config.load({"lost_progress_exit": taken}, environ={})


def _lost_batch_host(job_dir, node="n1", state="DOWN*"):
    """What the previous run left: its start, and the janitor's record of its lost batch host."""
    events.emit("start", log_dir=job_dir, slots="n1,n2", requeues=0)
    events.emit("batch_host_lost", log_dir=job_dir, node=node, state=state, silent_s=16.2, action="requeue",
                reason="the supervisor's node is lost and hpcft run with it: requeued by the janitor of n2")


def test_a_requeued_run_says_at_its_start_and_in_its_summary_that_the_previous_run_lost_its_batch_host(tmp_path):
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    _lost_batch_host(job_dir)
    slurm = _Slurm()
    sup = _supervisor(tmp_path, slurm)
    layout = Layout.plan(["n4", "n2", "n3"], active=2, spares=1, tasks_per_node=2)
    _report(sup, dict.fromkeys(range(layout.world_size), 12))  # the previous run's status.json
    sup.ledger.previous_run(layout, requeues=1)
    said = _said(sup, "previous_run")
    assert len(said) == 1 and said[0]["level"] in ("WARNING", "ERROR"), said
    assert said[0]["node"] == "n1" and "batch host n1" in said[0]["reason"] and "DOWN*" in said[0]["reason"]
    assert said[0]["reached"] == 12
    slurm.steps = [(lambda: _restored(sup, layout.world_size, 10), 0)]
    sup._launch(layout, 1)
    assert [(x.reached, x.resumed_from) for x in sup.ledger.lost] == [(12, 10)]
    assert "batch host n1" in sup.ledger.lost[0].reason
    sup._finish(Decision(Action.DONE, "every task exited 0", layout, 0), RunState(requeues=1))
    summary = _said(sup, "summary")[-1]
    assert summary["level"] in ("WARNING", "ERROR") and "batch host n1" in summary["previous_run"], summary
    assert "2 step(s) lost" in summary["previous_run"], summary


def test_a_requeued_run_after_a_lost_batch_host_that_lost_nothing_still_says_why_it_was_requeued(tmp_path):
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    _lost_batch_host(job_dir)
    sup = _supervisor(tmp_path, _Slurm())
    layout = Layout.plan(["n4", "n2", "n3"], active=2, spares=1)
    sup.ledger.previous_run(layout, requeues=1)
    sup._finish(Decision(Action.DONE, "every task exited 0", layout, 0), RunState(requeues=1))
    summary = _said(sup, "summary")[-1]
    assert summary["level"] == "WARNING" and "batch host n1" in summary["previous_run"], summary
    assert summary["exit_code"] == 0


def test_a_requeue_the_run_asked_for_itself_is_no_lost_batch_host(tmp_path):
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    _lost_batch_host(job_dir)
    events.emit("start", log_dir=job_dir, slots="n4,n2", requeues=1)  # a later run, requeued by its own supervisor
    events.emit("requeue", log_dir=job_dir, reason="walltime warning signal")
    sup = _supervisor(tmp_path, _Slurm())
    sup.ledger.previous_run(Layout.plan(["n4", "n2", "n3"], active=2, spares=1), requeues=2)
    assert _said(sup, "previous_run") == []


@pytest.mark.parametrize("states,excluded,allowed,says,never", [
    # found bad by hpcft's probe, healthy to Slurm: excluded, and said to be so (not "Slurm itself marked bad")
    ({"n2": "IDLE"}, ["n2"], [], ["n2", "IDLE", "ExcNodeList"], ["Slurm itself marked"]),
    # Slurm marked it: not excluded, and that is what Slurm reported
    ({"n2": "DOWN*"}, [], [], ["n2", "DOWN*", "not put into ExcNodeList"], []),
    # too few nodes in service without it
    ({"n2": "IDLE", "n3": "DOWN", "n4": "DOWN", "n5": "DOWN", "n6": "DOWN"}, [], ["n2"],
     ["n2", "cannot start without"], ["Slurm itself marked"]),
])
def test_requeued_says_what_slurm_reported_of_each_node_found_bad(tmp_path, states, excluded, allowed, says, never):
    sup = _supervisor(tmp_path, _Slurm({"n1": "ALLOCATED", **states}))
    layout = Layout.plan(NODES, active=2, spares=1)
    sup._finish(Decision(Action.REQUEUE, "no spare left", layout, 4),
                RunState(excluded=["n2"], slots=list(layout.slots)))
    said = _said(sup, "requeued")[-1]
    assert said["slurm_excluded"] == ",".join(excluded) and said["allowed"] == ",".join(allowed), said
    assert all(word in said["reason"] for word in says), said
    assert not any(word in said["reason"] for word in never), said

