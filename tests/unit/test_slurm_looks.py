"""The supervisor's looks at Slurm while the trainers run, with a fake clock (hpcft/launch/policy/slurmlook.py,
hpcft/launch/watch/slurm.py): at steady state Slurm is asked at most once per --slurm-check-every, with one
`scontrol show node` of every slot; at once on suspicion (an srun error, a node's reports silent), then every
SUSPECT_EVERY_S until the suspicion has lasted SUSPECT_FOR_S without a new sign."""
import subprocess

from hpcft.launch.fabric.liveview import BLIND_S, LiveView
from hpcft.launch.policy.layout import Layout
from hpcft.launch.policy.slurmlook import SUSPECT_EVERY_S, SUSPECT_FOR_S, SlurmLooks, srun_trouble
from hpcft.launch.node.nodecheck import NodeCheck
from hpcft.launch.watch.slurm import SlurmWatch

T0 = 1_700_000_000.0
SLOTS = ("n1", "n2", "n3", "n4")


def test_the_timer_asks_once_per_period_and_a_suspicion_at_once_then_often_until_it_lapses():
    looks = SlurmLooks(30.0, last=T0)
    asked = []
    for t in range(0, 300):  # a poll a second for five minutes, nothing suspicious
        if looks.due(T0 + t):
            asked.append(t)
            looks.looked(T0 + t)
    assert asked == [30, 60, 90, 120, 150, 180, 210, 240, 270]
    looks.suspect(T0 + 300.5, "srun: error: n3: task 2: Killed")
    assert looks.due(T0 + 300.5).startswith("suspicion: srun: error")  # at once, whatever the timer says
    looks.looked(T0 + 300.5)
    assert looks.due(T0 + 301) is None  # answered
    assert looks.due(T0 + 300.5 + SUSPECT_EVERY_S).startswith("suspicion")  # Slurm marks a dead node late
    looks.looked(T0 + 300.5 + SUSPECT_EVERY_S)
    assert looks.due(T0 + 300.5 + SUSPECT_FOR_S + 1) == "timer"  # lapsed: the slow timer again
    looks.looked(T0 + 300.5 + SUSPECT_FOR_S + 1)
    assert looks.due(T0 + 300.5 + SUSPECT_FOR_S + 2) is None


def test_srun_trouble_is_srun_saying_so_not_the_tasks_own_lines():
    assert srun_trouble(["rank 0: step 7", "Traceback (most recent call last):", "RuntimeError: error"]) is None
    assert srun_trouble(["srun: launching StepId=7.3 on host n2, 1 tasks: 0"]) is None
    assert srun_trouble(["x", "srun: error: n3: task 2: Killed"]) == "srun: error: n3: task 2: Killed"
    assert srun_trouble(["srun: Job step aborted: Waiting up to 32 seconds for job step to finish."])


class CountingSlurm:
    """A narrow stand-in for the Runner: counts each scontrol call, answers for a 4-node job."""

    def __init__(self):
        self.calls: list[str] = []
        self.states = dict.fromkeys(SLOTS, "MIXED")

    def run(self, argv, **_):
        self.calls.append(" ".join(argv[:3]))
        if argv[:3] == ["scontrol", "show", "job"]:
            out = "JobId=7 NodeList=n[1-4] TimeLimit=UNLIMITED EndTime=Unknown BatchFlag=1 Requeue=1 Restarts=0"
        else:
            out = "\n".join(f"NodeName={n} State={self.states[n]}" for n in argv[-1].split(","))
        return subprocess.CompletedProcess(argv, 0, out, "")


def _watch(slurm, said, now, period=30.0):
    view = LiveView()
    check = NodeCheck(slurm, "7", {}, 5.0, lambda *a, **k: None)
    return view, SlurmWatch(check, view, Layout(slots=SLOTS), period, T0, said, clock=lambda: now[0])


def test_at_steady_state_the_watch_asks_one_scontrol_show_node_per_period_whatever_the_job_size():
    slurm, said, now = CountingSlurm(), [], [T0]
    view, watch = _watch(slurm, said, now)
    for t in range(0, 600):  # ten minutes, every node reporting every 5 s
        now[0] = T0 + t
        if t % 5 == 0:
            for slot in range(len(SLOTS)):
                view.apply({"tag": "0", "slot": slot, "node": SLOTS[slot]}, now[0])
        assert watch.poll() == {}
    assert slurm.calls == ["scontrol show node"] * 19  # at 30, 60 … 570 s: 2 a minute, one RPC for every slot
    slurm.states["n3"] = "MIXED+DRAIN"  # an admin's drain: seen on the timer, and no loss
    now[0] = T0 + 630
    assert watch.poll() == {} and watch.nodes.closed_now == {"n3": "MIXED+DRAIN"}


def test_an_srun_error_asks_slurm_at_once_with_the_allocation_and_a_lost_node_is_named():
    slurm, said, now = CountingSlurm(), [], [T0]
    _, watch = _watch(slurm, said, now)
    now[0] = T0 + 3
    assert watch.poll() == {} and slurm.calls == []
    said += ["rank 2: step 9", "srun: error: n3: task 2: Killed"]
    now[0] = T0 + 4
    assert watch.poll() == {} and slurm.calls == ["scontrol show job", "scontrol show node"]  # not down yet
    slurm.states["n3"] = "DOWN+NOT_RESPONDING"
    now[0] = T0 + 4 + SUSPECT_EVERY_S  # Slurm's mark comes after its SlurmdTimeout: asked again meanwhile
    assert watch.poll() == {"n3": "DOWN+NOT_RESPONDING"}


def test_a_node_whose_reports_stop_is_a_suspicion_one_never_heard_is_not():
    slurm, said, now = CountingSlurm(), [], [T0]
    view, watch = _watch(slurm, said, now)
    for slot in range(3):  # n4 has not reported yet (starting): not judged
        view.apply({"tag": "0", "slot": slot, "node": SLOTS[slot]}, T0 + 1)
    for t in range(2, int(BLIND_S) + 2):
        now[0] = T0 + t
        for slot in (0, 1):  # n3 falls silent after its first report
            view.apply({"tag": "0", "slot": slot, "node": SLOTS[slot]}, now[0])
        watch.poll()
    assert slurm.calls == []
    now[0] = T0 + BLIND_S + 2
    watch.poll()
    assert slurm.calls == ["scontrol show job", "scontrol show node"]
    assert watch.looks.suspicion == "no report from n3"


def test_a_node_that_stays_silent_is_one_suspicion_not_a_poll_of_slurm_for_good():
    slurm, said, now = CountingSlurm(), [], [T0]
    view, watch = _watch(slurm, said, now)
    for slot in range(len(SLOTS)):
        view.apply({"tag": "0", "slot": slot, "node": SLOTS[slot]}, T0 + 1)
    for t in range(2, 400):  # n3's reporter never reaches the supervisor again; the others report every 5 s
        now[0] = T0 + t
        if t % 5 == 0:
            for slot in (0, 1, 3):
                view.apply({"tag": "0", "slot": slot, "node": SLOTS[slot]}, now[0])
        watch.poll()
    suspicious = SUSPECT_FOR_S / SUSPECT_EVERY_S + 1  # asked at once, then every 2 s while the suspicion lasts
    assert watch.asked <= suspicious + (400 - SUSPECT_FOR_S) / 30 + 1  # then on the slow timer again
