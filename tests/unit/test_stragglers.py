"""Stragglers: the rank's own share of a step (hpcft/snapshot/timing.py), carried by the nodes' reports, judged by the
pure detector (hpcft/launch/policy/stragglers.py) with a fake clock, and the supervisor's watch and decision."""
import time

import pytest
import torch

from hpcft.errors import ConfigError
from hpcft.launch.config import model as config
from hpcft.launch.fabric.liveview import LiveView
from hpcft.launch.policy.layout import Layout
from hpcft.launch.policy.failures import Action, Event, Kind, State, decide
from hpcft.launch.policy.stragglers import Detector, StragglerRules, eviction_blocked
from hpcft.launch.watch.stragglers import StragglerWatch
from hpcft.snapshot.timing import CpuClock, StepTimer
from hpcft.store import progress
from hpcft.store.paths import progress_file

NODES = ("n1", "n2", "n3", "n4")


def feed(det: Detector, t: float, values: dict[int, float], step: int) -> None:
    for rank, value in values.items():
        det.observe(rank, NODES[rank // 2], step, value, t)


def run(det: Detector, steps: range, slow: dict[int, float] | None = None, every: float = 1.0,
        base: float = 0.2) -> list:
    """One sample per rank per second (8 ranks, 2 per node); `slow`: {step: value of rank 3} for those steps."""
    said = []
    for step in steps:
        t = step * every
        feed(det, t, {r: (slow or {}).get(step, base) if r == 3 else base for r in range(8)}, step)
        new, cleared = det.judge(t)
        said += [("new", v.node, v.ranks) for v in new] + [("cleared", v.node, v.ranks) for v in cleared]
    return said


def test_a_node_persistently_slower_than_its_peers_is_named_once_with_its_slow_rank():
    det = Detector(StragglerRules(factor=1.5, window=6))
    said = run(det, range(0, 20), slow={s: 0.5 for s in range(5, 20)})
    assert said == [("new", "n2", (3,))]
    v = det.named["n2"]
    assert v.ready_s == 0.5 and v.peers_s == 0.2 and v.ratio == pytest.approx(2.5)


def test_a_pause_shorter_than_the_loss_timeout_is_never_a_straggler():
    """A pause stops a rank in one place: one step's sample, however long, among the window's others."""
    det = Detector(StragglerRules(factor=1.5, window=6))
    # paused for 4 s (under a 5 s --loss-timeout) in step 8: every rank waited, no samples meanwhile, then one slow one
    samples = {s: 4.2 for s in (8,)}
    said = []
    for step in range(0, 20):
        t = step + (4 if step >= 8 else 0)
        feed(det, t, {r: samples.get(step, 0.2) if r == 3 else 0.2 for r in range(8)}, step)
        said += det.judge(t)[0]
    assert said == []


def test_too_few_samples_or_too_short_a_span_judge_nothing():
    det = Detector(StragglerRules(factor=1.5, window=10, min_samples=3))
    said = run(det, range(0, 4), slow={s: 2.0 for s in range(4)}, every=1.0)  # 4 samples spanning 3 s < 5 s
    assert said == [] and det.measure(3, 3.0) is None


def test_a_straggler_is_cleared_below_half_way_and_noise_under_the_floor_is_no_straggler():
    det = Detector(StragglerRules(factor=1.5, window=6))
    slow = {s: 0.5 for s in range(0, 10)} | {s: 0.26 for s in range(10, 30)}  # ratio 1.3: above 1.25, stays named
    slow |= {s: 0.22 for s in range(30, 40)}
    said = run(det, range(0, 40), slow=slow)
    assert [s[0] for s in said] == ["new", "cleared"]
    quiet = Detector(StragglerRules(factor=1.5, window=6))
    assert run(quiet, range(0, 20), slow={s: 0.004 for s in range(20)}, base=0.001) == []  # 4x, but 3 ms
    assert run(Detector(StragglerRules(factor=0, window=6)), range(0, 20), slow={s: 9.0 for s in range(20)}) == []


def test_an_eviction_needs_the_option_protection_a_spare_and_relaunches_left():
    ok = dict(evict=True, protected=True, spares=1, restarts=0, max_restarts=3)
    assert eviction_blocked(**ok) is None
    assert "off" in eviction_blocked(**{**ok, "evict": False})
    assert "protect" in eviction_blocked(**{**ok, "protected": False})
    assert "no spare" in eviction_blocked(**{**ok, "spares": 0})
    assert "max-restarts" in eviction_blocked(**{**ok, "restarts": 3})


def test_the_decision_evicts_onto_a_spare_even_past_the_restart_count():
    layout = Layout(("n1", "n2", "n3"), spares=("n4",))
    event = Event(Kind.STRAGGLER, bad_nodes=("n2",), detail="n2: ready_s 0.5 s")
    got = decide(event, State(layout=layout, restarts=3, max_restarts=3), now=0.0)
    assert got.action is Action.EVICT and got.replaced == {"n2": "n4"}
    assert got.layout.slots == ("n1", "n4", "n3") and "n2" in got.layout.excluded


def test_options_are_checked():
    assert config.load({"straggler_factor": 2, "straggler_window": 5, "evict_stragglers": True}, environ={})
    for bad in ({"straggler_factor": 1.0}, {"straggler_window": 0}, {"evict_stragglers": True, "protect": "none"},
                {"evict_stragglers": True, "straggler_factor": 0}):
        with pytest.raises(ConfigError):
            config.load(bad, environ={})


def test_the_watch_reports_and_evicts_once_the_detection_step_is_protected(tmp_path):
    events: list[tuple[str, dict]] = []
    cfg = config.make(protect="xor", straggler_window=6, evict_stragglers=True)
    view = LiveView()  # what the nodes reported over the network
    watch = StragglerWatch(cfg, view.samples, lambda kind, **f: events.append((kind, f)))
    layout = Layout(NODES[:3], spares=("n4",), tasks_per_node=2)
    watch.launched(cfg, restarts=0, now=0.0)
    protected = {"step": None}
    due = None
    for step in range(1, 15):
        view.apply({"progress": {str(rank): [step, 0.6 if rank == 2 else 0.2] for rank in range(6)}}, time.time())
        due = watch.poll(layout, lambda: protected["step"], now=time.time() + step)
        if due is not None:
            break
        if events and protected["step"] is None:
            protected["step"] = events[0][1]["step"] - 1  # protection still behind the detection
        elif events:
            protected["step"] = events[0][1]["step"]
    assert [k for k, _ in events] == ["straggler"]
    said = events[0][1]
    assert said["node"] == "n2" and said["ranks"] == "2" and said["action"].startswith("evict")
    assert due is not None and due.kind is Kind.STRAGGLER and due.bad_nodes == ("n2",)
    assert f"step {said['step']} protected" in due.detail


def test_without_a_spare_the_straggler_is_only_reported(tmp_path):
    events: list[tuple[str, dict]] = []
    cfg = config.make(protect="xor", straggler_window=6, evict_stragglers=True)
    view = LiveView()  # what the nodes reported over the network
    watch = StragglerWatch(cfg, view.samples, lambda kind, **f: events.append((kind, f)))
    watch.launched(cfg, restarts=0, now=0.0)
    layout = Layout(NODES[:3], tasks_per_node=2)
    for step in range(1, 15):
        view.apply({"progress": {str(rank): [step, 0.6 if rank == 5 else 0.2] for rank in range(6)}}, time.time())
        assert watch.poll(layout, lambda: 100, now=time.time() + step) is None
    assert [(k, f["node"], f["action"]) for k, f in events] == [("straggler", "n3", "reported only")]
    assert "no spare" in events[0][1]["reason"]


def test_the_nodes_progress_carries_the_snapshots_measure_and_still_reads_a_bare_step(tmp_path):
    job = tmp_path / "store"
    store = job / "rank-00000"
    store.mkdir(parents=True)
    (store / "slot-0.json").write_text('{"step": 4, "timing": {"ready_s": 0.25, "steps": 1}}')
    (store / "slot-1.json").write_text('{"step": 3}')
    assert progress.newest(store) == (4, 0.25)
    progress_file(job, 1).parent.mkdir()
    progress_file(job, 1).write_text("7")  # a job writing $HPCFT_PROGRESS_FILE itself
    progress.write(progress_file(job, 0), 2)  # older than its manifests: the newer step wins
    assert progress.node(job) == {0: (4, 0.25), 1: (7, None)}
    assert progress.node(job, ranks=[1, 2]) == {1: (7, None)}


class LateClock(CpuClock):
    """A device clock: a pair resolves only once `done` says so (a CUDA event not yet completed)."""
    done = False

    marks = 0

    def mark(self, again=None):
        self.marks += again is None  # a new mark; `again` re-records the step's gradient mark
        return super().mark(again)

    def elapsed(self, start, end):
        return end - start if self.done else None


def test_the_timer_waits_for_marks_a_device_has_not_reached():
    clock = LateClock()
    timer = StepTimer(clock)
    timer.ended()  # the first step of a launch has no start: nothing
    timer.started()
    for _ in range(5):  # every parameter's gradient: one mark, moved
        timer.grad()
    timer.ended()
    assert clock.marks == 2 and timer.report() is None
    clock.done = True
    got = timer.report()
    assert got is not None and got["steps"] == 1 and got["ready_s"] >= 0
    assert timer.report() is None  # reported once


def test_ready_s_ends_at_the_last_gradient_not_at_the_wait_before_the_optimizer(tmp_path):
    """The real Checkpointer on a CPU: a step that sleeps in its forward, then waits (a peer's collective) after its
    backward: the snapshot's ready_s holds the first, not the second."""
    from hpcft.checkpointer import Checkpointer
    from hpcft.options import Options

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wait_s = 0.5
    with Checkpointer(model, opt, Options(root=tmp_path, job_id="t")) as ckpt:
        walls = []
        for _ in range(3):
            began = time.perf_counter()
            time.sleep(0.02)
            model(torch.ones(2, 4)).sum().backward()
            time.sleep(wait_s)  # waiting for the slowest peer in the gradient all-reduce
            opt.step()
            opt.zero_grad()
            walls.append(time.perf_counter() - began)
        ckpt.wait()
        got = progress.newest(ckpt.store.dir)
    assert got is not None and got[0] == 3 and got[1] is not None
    assert 0.02 <= got[1] <= max(walls) - wait_s
