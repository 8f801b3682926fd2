"""Progress and status over the network (issue #16 item 3): the deltas a node sends, the supervisor's live view
(fake clock), the bounded log's pace, and a real uplink talking to a real report service over TCP."""
import json
import threading
import time

from hpcft import events
from hpcft.agent.transport import secret as job_secret
from hpcft.agent import status as agent_status
from hpcft.agent.transport.uplink import Uplink, delta, patch
from hpcft.launch.node import progress
from hpcft.launch.fabric.service import Fabric
from hpcft.launch.fabric.reports import DRAIN_S
from hpcft.launch.fabric.liveview import BLIND_S, KEEP_TAGS, LOG_BYTES_PER_S, LiveView, Rounds, blind, next_write
from hpcft.status import collect


def test_a_delta_carries_only_what_changed_and_patches_back_to_the_new_status():
    old = {"phase": "ready", "staged": 3, "error": "x", "time": 1.0}
    new = {"phase": "ready", "staged": 4, "time": 2.0, "protected": 3}
    changed, dropped = delta(old, new)
    assert changed == {"staged": 4, "time": 2.0, "protected": 3} and dropped == ["error"]
    assert patch(old, changed, dropped) == new
    assert delta(new, new) == ({}, [])


def test_the_view_merges_deltas_and_a_step_it_already_holds_is_no_progress():
    view = LiveView()
    view.apply({"tag": "0", "slot": 1, "full": True, "set": {"phase": "ready", "time": 5.0, "error": None},
                "progress": {"2": [7, 0.5], "3": [7, None]}}, now=100.0)
    view.apply({"tag": "0", "slot": 1, "set": {"phase": "protecting", "time": 6.0}, "drop": ["error"],
                "progress": {"2": [7, 0.5]}}, now=101.0)  # a relaunch's agent reports the store's last step again
    assert view.reports("0") == {1: {"phase": "protecting", "time": 6.0}}
    assert view.samples() == {2: (7, 0.5, 100.0), 3: (7, None, 100.0)}
    assert view.last_change(since=100.0) == 100.0  # nothing after the launch at 100: the hang clock runs on
    view.apply({"tag": "0", "slot": 1, "progress": {"3": [8, 0.4]}}, now=102.0)
    assert view.last_change(since=100.0) == 102.0
    assert view.reached(world=4) is None and view.reached(world=2) is None  # ranks 0, 1 have said nothing
    view.apply({"tag": "0", "slot": 0, "progress": {"0": [9, None], "1": [6, None]}}, now=103.0)
    assert view.reached(world=4) == 6
    view.apply({"tag": "0", "slot": 1, "full": True, "set": {"phase": "stopped", "time": 7.0}}, now=104.0)
    assert view.reports("0")[1] == {"phase": "stopped", "time": 7.0}  # a whole status replaces the old one


def test_agents_the_supervisor_stopped_are_stopped_in_the_view_and_a_late_report_does_not_revive_them():
    """CI: agents killed after --kill-grace never said "stopped", and `hpcft status` after the run said
    "protecting" for nodes whose agents were gone."""
    view = LiveView()
    for slot, phase in enumerate(("protecting", "stopped", "failed")):
        view.apply({"tag": "2", "slot": slot, "full": True, "set": {"phase": phase, "time": 5.0}}, now=100.0)
    view.apply({"tag": "1", "slot": 0, "full": True, "set": {"phase": "protecting", "time": 4.0}}, now=100.0)
    before = view.version
    assert view.ended("2", "killed") == [0] and view.version > before
    assert view.reports("2")[0] == {"phase": "stopped", "time": 5.0, "stopped_by": "supervisor", "how": "killed",
                                    "last_phase": "protecting"}
    assert [view.reports("2")[s]["phase"] for s in (1, 2)] == ["stopped", "failed"]  # their own word stays
    assert view.reports("1")[0]["phase"] == "protecting"  # another launch's
    assert view.reports(None)[0]["time"] == 5.0  # no newer than what the node said: the newest launch still wins
    view.apply({"tag": "2", "slot": 0, "set": {"phase": "protecting", "protected": 9}}, now=101.0)  # sent before
    assert view.reports("2")[0]["phase"] == "stopped" and view.reports("2")[0]["protected"] == 9
    view.apply({"tag": "2", "slot": 0, "set": {"phase": "stopped"}}, now=102.0)
    assert view.ended("2", "asked") == [] and view.reports("2")[0]["how"] == "killed"
    view.forget("2")
    view.apply({"tag": "2", "slot": 0, "full": True, "set": {"phase": "ready", "time": 9.0}}, now=103.0)
    assert view.reports("2")[0]["phase"] == "ready"  # a rerun of the tag starts afresh


def test_the_view_keeps_a_bounded_number_of_launches_and_forgets_a_rerun_tag():
    view = LiveView()
    for n in range(KEEP_TAGS + 3):
        view.apply({"tag": str(n), "slot": 0, "set": {"phase": "ready", "time": float(n)}}, now=float(n))
    assert len(view.dump(0.0)["agents"]) == KEEP_TAGS and "0" not in view.dump(0.0)["agents"]
    assert view.reports(None)[0]["time"] == KEEP_TAGS + 2  # the newest launch per slot
    before = view.version
    view.forget(str(KEEP_TAGS + 2))
    assert view.reports(str(KEEP_TAGS + 2)) == {} and view.version > before


def test_a_dumped_view_loads_back_for_a_requeued_run():
    view = LiveView()
    view.apply({"tag": "3", "slot": 0, "set": {"phase": "stopped", "time": 1.0}, "progress": {"0": [12, 0.1]}}, 50.0)
    again = LiveView()
    again.load(json.loads(json.dumps(view.dump(60.0))))
    assert again.reports("3") == view.reports("3") and again.samples() == view.samples()
    assert again.reached(world=1) == 12


def test_the_bounded_log_is_replaced_at_most_once_a_second_and_less_often_when_large():
    assert next_write(10.0, 2_000) == 11.0
    assert next_write(10.0, 12 * LOG_BYTES_PER_S) == 22.0  # a 12 MiB log (a very large job's): every 12 s


def _fabric(tmp_path) -> tuple[Fabric, bytes]:
    job = tmp_path / "job"
    job.mkdir()
    fabric = Fabric(job, emit=lambda *a, **k: None)
    fabric.start(None)
    return fabric, job_secret.load(job / job_secret.NAME)


def _until(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_an_agent_that_reports_it_failed_or_late_peers_raises_the_alarm_at_once_and_no_other_phase_does(tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    alarms = []
    fabric = Fabric(job, emit=lambda *a, **k: None, alarm=lambda: alarms.append(time.monotonic()))
    fabric.start(None)
    up = Uplink(fabric.server.address, job_secret.load(job / job_secret.NAME), tag="0", slot=1, node="n2",
                progress=dict, gap=1.0, every=0.1)
    try:
        up.status(phase="protecting", staged=3)
        _until(lambda: fabric.view.reports("0").get(1, {}).get("phase") == "protecting")
        assert alarms == []
        sent = time.monotonic()
        up.amend(late_peers=[3])  # from the beat thread: the round loop may be blocked on that peer
        _until(lambda: alarms, timeout=0.9)  # the supervisor probes it ahead of the loss timeout
        assert fabric.view.reports("0")[1]["late_peers"] == [3] and fabric.view.reports("0")[1]["staged"] == 3
        up.status(phase="protecting", staged=3, late_peers=[])  # heard again: no alarm
        _until(lambda: fabric.view.reports("0")[1]["late_peers"] == [], timeout=0.9)
        assert len(alarms) == 1
        alarms.clear()
        sent = time.monotonic()
        up.status(phase="failed", error="peer closed", peer_slot=2)
        _until(lambda: alarms, timeout=0.9)  # the supervisor wakes: it looks at the agents now, not at its next poll
        assert fabric.view.reports("0")[1]["peer_slot"] == 2 and alarms[0] - sent < 0.9
    finally:
        up.close()
        fabric.close()


def test_a_newly_protected_step_is_reported_at_once_other_changes_wait_for_the_gap(tmp_path):
    fabric, secret = _fabric(tmp_path)
    up = Uplink(fabric.server.address, secret, tag="0", slot=1, node="n2", progress=dict, gap=5.0, every=5.0)
    try:
        up.status(phase="protecting", staged=3, protected=3)
        _until(lambda: fabric.view.reports("0").get(1, {}).get("protected") == 3)
        up.status(phase="protecting", staged=4, protected=3)  # staged alone: within the next gap
        time.sleep(0.5)
        assert fabric.view.reports("0")[1]["staged"] == 3
        up.status(phase="protecting", staged=5, protected=5)  # a set's members commit a step together
        _until(lambda: fabric.view.reports("0")[1].get("protected") == 5, timeout=2.0)
        for change in ({"drained": True}, {"flushing": True}, {"flushing": False, "flushed_request": "r1"}):
            up.status(phase="protecting", staged=5, protected=5, **{"drained": True, **change})  # a persist waits
            _until(lambda: all(fabric.view.reports("0")[1].get(k) == v for k, v in change.items()), timeout=2.0)
    finally:
        up.close()
        fabric.close()


def test_an_uplink_coalesces_its_reports_sends_a_new_phase_at_once_and_its_last_one_on_close(tmp_path):
    fabric, secret = _fabric(tmp_path)
    ranks = {4: (1, 0.3), 5: (1, 0.2)}
    up = Uplink(fabric.server.address, secret, tag="0", slot=2, node="n3", progress=lambda: dict(ranks),
                gap=1.0, every=0.1)
    try:
        up.status(phase="rebuilding", staged=None)
        _until(lambda: fabric.view.reports("0").get(2, {}).get("phase") == "rebuilding")
        started, sent = time.monotonic(), up.sent
        for step in range(2, 40):  # many reports within about a second: at most two or three messages
            ranks[4] = (step, 0.3)
            up.status(phase="rebuilding", staged=step)
            time.sleep(0.02)
        gone = time.monotonic() - started
        assert up.sent - sent <= 2 + gone, (up.sent - sent, gone)
        up.status(phase="ready", staged=39)  # a new phase: at once, not after the gap
        _until(lambda: fabric.view.reports("0")[2]["phase"] == "ready", timeout=0.9)
        up.status(phase="stopped", staged=39)
    finally:
        up.close()
    _until(lambda: fabric.view.reports("0")[2]["phase"] == "stopped")  # sent before close returned
    assert fabric.view.samples()[4][0] == 39 and fabric.view.samples()[5][:2] == (1, 0.2)
    fabric.close()


def test_the_last_report_still_in_the_socket_when_the_run_ends_reaches_the_log(tmp_path):
    """CI: an agent's "stopped" was sent before it exited, but the service stopped reading first; `hpcft status`
    after the run said "protecting". Here the service's thread is kept from reading until the run ends."""
    fabric, secret = _fabric(tmp_path)
    up = Uplink(fabric.server.address, secret, tag="0", slot=0, node="n1", every=0.1)
    up.status(phase="protecting", staged=3)
    _until(lambda: fabric.view.reports("0").get(0, {}).get("phase") == "protecting")
    server, select = fabric.server, fabric.server._sel.select

    def busy(timeout):  # a descheduled service thread: nothing read while the run goes on
        if not server._stopped:
            time.sleep(min(timeout, 0.05))
            return []
        return select(timeout)
    server._sel.select = busy
    server._wake_w.send(b"x")  # out of the select it is in, into the busy one
    time.sleep(0.2)
    up.status(phase="stopped", staged=3)
    up.close()
    fabric.close()
    assert agent_status.read(fabric.job_dir / "agents", "0")[0]["phase"] == "stopped"


def test_a_last_report_on_its_way_when_the_run_ends_is_waited_for_until_the_node_closes(tmp_path):
    """The service stops reading only once every node has closed (its agent ended) or nothing came for QUIET_S:
    a report sent just after close() began, still reaches the log."""
    fabric, secret = _fabric(tmp_path)
    up = Uplink(fabric.server.address, secret, tag="0", slot=0, node="n1", every=0.1)
    up.status(phase="protecting", staged=3)
    _until(lambda: fabric.view.reports("0").get(0, {}).get("phase") == "protecting")

    def late():
        time.sleep(0.1)
        up.status(phase="stopped", staged=3)
        up.close()
    t = threading.Thread(target=late)
    t.start()
    started = time.monotonic()
    fabric.close()
    t.join()
    assert agent_status.read(fabric.job_dir / "agents", "0")[0]["phase"] == "stopped"
    assert time.monotonic() - started < DRAIN_S + 1


def test_events_travel_to_the_supervisors_events_file_and_the_log_serves_status_and_progress(tmp_path):
    fabric, secret = _fabric(tmp_path)
    up = Uplink(fabric.server.address, secret, tag="1", slot=0, node="n1", progress=lambda: {0: (3, 0.1)},
                every=0.1)
    _until(lambda: up.connected)
    events.forward(up.event)
    try:
        events.emit("snapshot_protected", step=3, slot=0)
    finally:
        events.forward(None)
    up.status(node="n1", phase="protecting", staged=3, protected=3, scheme="none", slots=1, interval=1.0, versions={"0": [3]},
              protected_steps=[3])
    up.close()
    _until(lambda: any(e["event"] == "snapshot_protected" for e in events.read(fabric.job_dir)))
    fabric.close()  # the run's end: the last view is in the log
    assert agent_status.read(fabric.job_dir / "agents", "1")[0]["protected"] == 3  # no status files: the log
    assert progress.read(fabric.job_dir)[0][0] == 3
    view = collect(fabric.job_dir)
    assert view.nodes[0].node == "n1" and view.nodes[0].protected == 3


def test_the_log_is_written_at_most_about_once_a_second_while_reports_stream_in(tmp_path):
    fabric, secret = _fabric(tmp_path)
    ups = [Uplink(fabric.server.address, secret, tag="0", slot=s, node=f"n{s}", gap=0.05) for s in range(4)]
    started = time.monotonic()
    while time.monotonic() - started < 3.0:
        for s, up in enumerate(ups):
            up.status(phase="protecting", time_s=time.monotonic())
        time.sleep(0.01)
    for up in ups:
        up.close()
    elapsed = time.monotonic() - started
    assert fabric.server.received > 20  # the reports did stream in
    assert 1 <= fabric.writes <= elapsed + 2, (fabric.writes, elapsed)
    fabric.close()


def test_the_agents_per_round_events_are_summed_into_one_record_per_protected_step():
    rounds = Rounds()
    rec = {"event": "snapshot_protected", "time": 1.0, "scheme": "xor", "held_bytes": 10, "sent_bytes": 4}
    assert rounds.add("0", {**rec, "step": 5, "slot": 0, "seconds": 0.2}, slots=3) is None
    assert rounds.add("0", {**rec, "step": 4, "slot": 2, "seconds": 0.1}, slots=3) is None  # an older step, left open
    assert rounds.add("0", {**rec, "step": 5, "slot": 1, "seconds": 0.5}, slots=3) is None
    got = rounds.add("0", {**rec, "step": 5, "slot": 2, "seconds": 0.3, "time": 2.0}, slots=3)
    assert got == {"event": "snapshot_protected", "time": 2.0, "level": "INFO", "tag": "0", "step": 5, "slots": 3,
                   "scheme": "xor", "held_bytes": 30, "sent_bytes": 12, "seconds": 0.5}
    assert rounds._open == {}  # step 4 went with step 5: a set that never completes it holds no memory


def test_a_blind_view_is_no_hang_but_a_launch_never_heard_from_is_judged_as_before(tmp_path):
    said = []
    now = [1000.0]
    fabric = Fabric(tmp_path, emit=lambda kind, **f: said.append(kind), clock=lambda: now[0])
    fabric.view.apply({"tag": "0", "slot": 0, "progress": {"0": [3, None]}}, now=1010.0)
    now[0] = 1010.0 + 5.0
    assert fabric.hung(launched=1000.0, hang_timeout=10.0, start_timeout=0.0) is None  # a step 5 s ago
    fabric.view.apply({"tag": "0", "slot": 0}, now=1014.0)  # an empty report (keepalive): alive, no progress
    now[0] = 1020.0
    assert "no completed step" in fabric.hung(1000.0, 2.0, 0.0)
    now[0] = 1014.0 + BLIND_S + 1  # then every node went silent: the reports are lost, not the progress
    assert fabric.hung(1000.0, 2.0, 0.0) is None and fabric.hung(1000.0, 2.0, 0.0) is None
    assert said == ["progress_blind"]
    assert "since the launch" in fabric.hung(launched=now[0] - 10, hang_timeout=2.0, start_timeout=5.0)
    assert blind(100.0, 0.0, None) is False and blind(100.0, 50.0, 40.0) is False and blind(100.0, 0.0, 40.0)


def test_a_node_that_cannot_reach_the_supervisor_writes_its_events_to_the_events_file(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCFT_EVENT_DIR", str(tmp_path))
    up = Uplink("127.0.0.1:9", b"x" * 64, tag="0", slot=0, node="n1", gap=0.05)  # nothing listens there
    events.forward(up.event)
    try:
        events.emit("peer_silent", level=30, slot=0, peer_slot=1)
    finally:
        events.forward(None)
        up.close()
    assert [e["event"] for e in events.read(tmp_path)] == ["peer_silent"]
    assert not up.connected


def test_the_supervisors_requests_reach_every_node_on_its_uplink_and_a_late_one_on_connecting(tmp_path):
    """#32: drain, stop and flush requests pushed down the uplinks, not request files each node polls on the shared
    file system; a node connecting after a request still gets it, and an agent reads it from memory."""
    fabric, secret = _fabric(tmp_path)
    early = Uplink(fabric.server.address, secret, tag="1", slot=0, node="n1", gap=0.05)
    late = None
    try:
        early.status(phase="ready")
        _until(lambda: fabric.view.reports("1").get(0, {}).get("phase") == "ready")
        fabric.order("1", drain=True)
        _until(lambda: early.orders.get("1", {}).get("drain") is True)
        fabric.order("1", flush="f00d")
        late = Uplink(fabric.server.address, secret, tag="1", slot=1, node="n2", gap=0.05)
        late.status(phase="ready")
        for up in (early, late):
            _until(lambda: up.orders.get("1") == {"drain": True, "flush": "f00d"})
        asked = agent_status.Requests(tmp_path / "agents", "1", lambda: late.orders)
        assert asked.drain() and not asked.stop() and asked.flush() == "f00d"
        assert agent_status.Requests(tmp_path / "agents", "2", lambda: late.orders).drain() is False  # another launch
        fabric.order("1", stop=True)
        _until(lambda: agent_status.Requests(tmp_path / "agents", "1", lambda: late.orders).stop())
        assert not list(tmp_path.glob("**/agent-1-*")), "no request file was needed"
    finally:
        for up in (early, late):
            if up is not None:
                up.close()
        fabric.close()


def test_agents_started_by_hand_read_the_request_files(tmp_path):
    from hpcft.agent.protection import flush as persist

    asked = agent_status.Requests(tmp_path, "0")
    assert not asked.drain() and not asked.stop() and asked.flush() is None
    agent_status.request_drain(tmp_path, "0")
    agent_status.request_stop(tmp_path, "0")
    rid = persist.request(tmp_path, "0")
    assert asked.drain() and asked.stop() and asked.flush() == rid


def test_an_agent_wakes_its_round_loop_for_a_new_flush_request_and_a_drain(tmp_path, monkeypatch):
    """A persist (walltime warning, requeue) waits for its drain and its flush: neither may wait for a round's
    interval to be seen."""
    from hpcft.agent import agent
    from hpcft.agent.agent import _watch_requests

    killed = []
    monkeypatch.setattr(agent.os, "kill", lambda pid, sig: killed.append(sig))  # a stop: SIGTERM to the agent

    class Throttle:
        released = False

        def release(self):
            self.released = True

    class Below:
        def level(self):
            pass

    orders: dict = {"0": {}}
    mesh, drained, wake = type("Mesh", (), {"throttle": Throttle()})(), threading.Event(), threading.Event()
    watcher = threading.Thread(target=_watch_requests, daemon=True, args=(
        agent_status.Requests(tmp_path, "0", lambda: orders), mesh, Below(), drained, wake, 0.01))
    watcher.start()
    time.sleep(0.1)
    assert not wake.is_set()
    orders["0"] = {"flush": "f1"}
    assert wake.wait(2.0) and not drained.is_set()
    wake.clear()
    orders["0"] = {"flush": "f1", "drain": True}
    assert wake.wait(2.0) and drained.is_set() and mesh.throttle.released
    wake.clear()
    time.sleep(0.1)
    assert not wake.is_set()  # nothing new asked
    orders["0"] = {"flush": "f1", "drain": True, "stop": True}
    watcher.join(2.0)
    assert not watcher.is_alive() and killed
