"""The chaos run's pure parts: the seeded schedule and the mix, and the figures from a job's records."""
import pytest

from hpcft.chaos import figures, schedule
from hpcft.errors import ConfigError


def test_the_schedule_is_seeded_poisson_and_weighs_kinds_by_the_mix():
    mix = schedule.parse_mix("rank_kill=3,hang")
    plan = schedule.draw(7, 60.0, 2000, mix)
    assert plan == schedule.draw(7, 60.0, 2000, mix) and plan != schedule.draw(8, 60.0, 2000, mix)
    gaps = [b.at - a.at for a, b in zip(plan, plan[1:])]
    assert 55 < sum(gaps) / len(gaps) < 65  # exponential gaps of mean --mtbf
    share = sum(f.kind == "rank_kill" for f in plan) / len(plan)
    assert 0.7 < share < 0.8 and {f.kind for f in plan} == {"rank_kill", "hang"}
    assert [round(t, 3) for t in schedule.arrivals(7, 60.0, plan[9].at + 1e-3)] == [f.at for f in plan[:10]]


@pytest.mark.parametrize("text,words", [("nosuch", "unknown fault kind 'nosuch'"), ("hang=x", "not a number"),
                                        ("hang=-1", "negative"), ("hang=0", "weighs no kind")])
def test_a_bad_mix_is_refused_naming_the_part(text, words):
    with pytest.raises(ConfigError, match=words):
        schedule.parse_mix(text)
    assert set(schedule.parse_mix("all")) == set(schedule.KINDS)


def _records():
    """Two ranks; launch 0.0 trains steps 0-4 at 1 s a step, a fault at t=5.5, launch 0.1 resumes from step 3."""
    recs = [{"what": "init", "run": "0.0", "rank": r, "t": 0.0} for r in (0, 1)]
    recs += [{"what": "step", "run": "0.0", "rank": r, "step": s, "t": s + 1.0 + r / 10}
             for s in range(5) for r in (0, 1)]
    recs += [{"what": "init", "run": "0.1", "rank": r, "t": 8.0} for r in (0, 1)]
    recs += [{"what": "restored", "run": "0.1", "rank": r, "step": 3, "t": 8.5} for r in (0, 1)]
    recs += [{"what": "step", "run": "0.1", "rank": r, "step": s, "t": s + 6.0} for s in range(3, 6) for r in (0, 1)]
    return recs


def test_progress_step_time_and_a_faults_recovery_and_lost_steps():
    curve = figures.progress(_records())
    assert [(s, run) for _, s, run in curve] == [(s, "0.0") for s in range(5)] + [(s, "0.1") for s in range(3, 6)]
    assert figures.step_seconds(curve) == pytest.approx(1.0)
    out = figures.outcome(curve, [(8.5, 3)], 5.5)
    assert out.recovery_s == pytest.approx(3.5) and out.steps_lost == 2  # steps 3 and 4 trained again
    assert figures.goodput(6, 1.0, 12.0) == 0.5
    # a rank killed just after recording step 4 (t=5.05): its peer completes step 4 after the kill, which is no
    # recovery; the relaunch's first step is
    flight = figures.in_flight(_records(), 5.05)
    assert flight == ("0.0", 4) and figures.outcome(curve, [(8.5, 3)], 5.05, flight).recovery_s == pytest.approx(3.95)


def test_the_saved_curve_is_thinned_but_keeps_both_ends_of_every_launch():
    curve = [(100.0 + i, i, "0.0") for i in range(1000)] + [(1200.0 + i, 990 + i, "0.1") for i in range(1000)]
    thinned = figures.thin(curve, 100.0, points=100)
    assert len(thinned) <= 105 and thinned[0] == [0.0, 0] and thinned[-1] == [2099.0, 1989]
    assert [999.0, 999] in thinned and [1100.0, 990] in thinned  # the launch's last step, the relaunch's first
    assert figures.thin(curve[:5], 100.0) == [[float(i), i] for i in range(5)] and figures.thin([], 0.0) == []


def test_the_baseline_replays_the_arrivals_with_youngs_interval():
    assert figures.young_interval(2.0, 100.0, 1.0) == 20  # sqrt(2 × 2 × 100) = 20 s of steps
    assert figures.baseline(10, 1.0, 0.0, 5.0, 1e9, [])[0] == 1.0  # no fault, free saves: all training
    good, k = figures.baseline(40, 1.0, 0.5, 4.0, 100.0, [25.2])
    assert k == 10  # a save every 10 steps: at 25.2 s, 24 steps done (2 saves) → back to 20, + 4 s restart
    assert good == pytest.approx(40 / (25.2 + 4.0 + 20 * 1.0 + 2 * 0.5))


def test_the_field_preset_weighs_llama3s_interruptions_onto_the_kinds():
    mix = schedule.parse_mix("field")
    assert set(mix) <= set(schedule.KINDS) and max(mix, key=mix.get) == "node_crash"
    assert sum(mix.values()) == pytest.approx(92.4)


def test_a_requeue_waits_from_hpcfts_requeue_to_the_next_runs_start():
    log = [{"event": "start", "time": 0.0}, {"event": "requeue", "time": 10.0},
           {"event": "batch_host_lost", "action": "requeue", "time": 10.5},  # a janitor's too: the first counts
           {"event": "start", "time": 24.0}, {"event": "batch_host_lost", "action": "takeover", "time": 30.0},
           {"event": "start", "time": 33.0}, {"event": "batch_host_lost", "action": "requeue", "time": 40.0},
           {"event": "start", "time": 71.0}]
    assert figures.requeue_waits(log) == [14.0, 31.0]
