"""The in-process restart's shield: an interrupt (a real asynchronous exception, as the watcher raises it) aimed at
a thread inside a section lands where the section ends, one aimed outside lands at once, and exactly one lands
when the delivery races the section's end."""
import ctypes
import threading
import time

from hpcft.inprocess import shield


class Boom(Exception):
    pass


def _raiser(tid: int):
    return lambda: ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(Boom))


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def _run(body) -> dict:
    seen: dict = {}
    ready = threading.Event()

    def target():
        seen["tid"] = threading.get_ident()
        try:
            body(seen, ready)
        except Boom:
            seen["boom_at"] = time.monotonic()
    t = threading.Thread(target=target)
    t.start()
    assert ready.wait(5)
    fired = shield.deliver(seen["tid"], _raiser(seen["tid"]))
    seen["delivered_at"], seen["fired_now"] = time.monotonic(), fired
    t.join(10)
    assert not t.is_alive()
    return seen


def test_an_interrupt_aimed_inside_a_section_lands_at_its_end_and_not_before():
    def body(seen, ready):
        with shield.section():
            with shield.section():  # nested: the outermost end counts
                ready.set()
                _spin(0.3)
                seen["inner_done"] = time.monotonic()
            _spin(0.1)
            seen["section_done"] = time.monotonic()
        _spin(5)  # the interrupt lands here
        seen["not_interrupted"] = True
    seen = _run(body)
    assert seen["fired_now"] is False
    assert "not_interrupted" not in seen and seen["boom_at"] >= seen["section_done"] >= seen["inner_done"]


def test_an_interrupt_aimed_outside_a_section_lands_at_once():
    def body(seen, ready):
        ready.set()
        _spin(5)
        seen["not_interrupted"] = True
    seen = _run(body)
    assert seen["fired_now"] is True and "not_interrupted" not in seen
    assert seen["boom_at"] - seen["delivered_at"] < 1.0


def test_a_delivery_racing_section_ends_fires_exactly_once_and_cancel_drops_a_parked_one():
    for _ in range(200):
        fired: list[int] = []
        stop = threading.Event()

        def sections():
            while not stop.is_set():
                with shield.section():
                    pass
        t = threading.Thread(target=sections)
        t.start()
        shield.deliver(t.ident, lambda: fired.append(1))
        stop.set()
        t.join(5)
        assert fired == [1]
    shield._depth[12345] = 1  # a thread inside a section
    assert shield.deliver(12345, lambda: fired.append(2)) is False
    shield.cancel(12345)
    del shield._depth[12345]
    assert fired == [1] and 12345 not in shield._deferred
