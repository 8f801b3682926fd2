"""The supervisor's protection watch: protection that stops advancing while the trainers go on is an error, said
once per stall, its end said too, and every stall a line of the run's summary; a short pause, the step in flight, a
run without protection steps yet but not yet behind, are none."""
import logging

from hpcft.launch.watch.protection import STALL_S, ProtectionWatch


def _watch():
    said = []
    watch = ProtectionWatch(lambda kind, **f: said.append((kind, f)), stall_s=STALL_S)
    watch.launched(now=0.0)
    return watch, said


def test_a_stall_is_an_error_once_its_end_is_said_and_both_are_in_the_summary():
    watch, said = _watch()
    watch.poll(5, 6, now=1.0)
    watch.poll(5, 40, now=STALL_S)  # not yet past STALL_S since step 5 was protected
    assert said == []
    watch.poll(5, 41, flushing=2, now=STALL_S + 2)
    watch.poll(5, 42, now=STALL_S + 3)
    ((kind, f),) = said
    assert kind == "protect_stalled" and f["level"] == logging.ERROR
    assert (f["protected"], f["training"], f["behind"], f["flushing"]) == (5, 41, 36, 2)
    assert watch.summary()["protection_stalled"].endswith("while the trainers reached 42 (unresolved)")
    watch.poll(43, 44, now=STALL_S + 10)
    assert [k for k, _ in said] == ["protect_stalled", "protect_resumed"] and said[1][1]["stalled_s"] == STALL_S + 9
    assert watch.summary() == {"protection_stalled": f"at step 5 for {STALL_S + 9:.0f} s while the trainers reached 44"}


def test_no_stall_while_protection_keeps_up_or_the_trainers_wait():
    watch, said = _watch()
    for t in range(0, 1000, 10):  # protection one step behind the trainers, all along
        watch.poll(t // 10, t // 10 + 1, now=float(t))
    watch.poll(99, 100, now=5000.0)  # the trainers wait (a persist): no step past the protected one
    watch.poll(99, None, now=6000.0)  # no progress known
    assert said == [] and watch.summary() == {}


def test_a_launch_whose_agents_never_protect_while_the_trainers_go_on_stalls_from_its_first_step():
    watch, said = _watch()
    watch.poll(None, 30, now=1.0)  # restored at 30
    watch.poll(None, 31, now=STALL_S + 5)
    assert said == []
    watch.poll(None, 32, now=STALL_S + 6)
    assert [(k, f["protected"], f["behind"]) for k, f in said] == [("protect_stalled", None, 2)]
    watch.launched(now=STALL_S + 7)  # a relaunch judges afresh; the stall stays in the summary
    assert "at no step for" in watch.summary()["protection_stalled"]
