"""Heartbeats between the node agents: a peer that stops answering without closing its connections (SIGSTOP, as a
frozen node's processes) is named by its neighbours once the loss timeout has passed, and each fails as if its
connection had closed; a peer paused for less than the timeout is not. Real agent processes (`python -m hpcft.agent`)
on real sockets, with empty stores (their rounds are all-gathers only)."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcft import events
from hpcft.agent.transport import secret as job_secret
from hpcft.agent import status as agent_status
from hpcft.agent.transport.heartbeat import period_for
from hpcft.agent.transport.mesh import overlay as neighbours
from hpcft.agent.protection.placement import Scheme
from hpcft.agent.settings import AgentConfig

AGENTS = 3
LOSS_S = 3.0


def test_the_overlay_is_symmetric_and_logarithmic():
    for size in (2, 3, 4, 5, 8, 100, 1000):
        rel = {s: set(neighbours(s, size)) for s in range(size)}
        assert all(s in rel[j] for s in rel for j in rel[s]), size  # each side watches the other
        assert all(s not in rel[s] and rel[s] for s in rel), size
        assert max(len(v) for v in rel.values()) <= 2 * (size - 1).bit_length(), size
    assert neighbours(0, 5) == [1, 2, 3, 4] and neighbours(0, 8) == [1, 2, 4, 6, 7]
    assert period_for(5.0) == 0.5 and period_for(3.0) == 0.3 and period_for(2.0) == 0.2


def test_a_failing_agent_with_a_late_peer_names_it_once_its_own_heartbeat_does_not_the_peer_that_aborted_first():
    """CI once saw slot 1 name slot 3, whose agent had shut its mesh over slot 2's silence 10 ms before slot 1's own
    heartbeat named slot 2: the supervisor probed the healthy node."""
    import threading
    from types import SimpleNamespace

    from hpcft.agent.agent import _silence

    beat = SimpleNamespace(timeout=LOSS_S, suspect=None, late=[2], cause="")
    threading.Timer(0.2, lambda: setattr(beat, "suspect", (2, 3.2)) or setattr(beat, "cause", "silent")).start()
    started = time.monotonic()
    named = _silence(beat)
    assert named is not None and named.peer_slot == 2 and 0.15 < time.monotonic() - started < LOSS_S
    assert _silence(SimpleNamespace(timeout=LOSS_S, suspect=None, late=[], cause="")) is None  # at once: none late
    never = SimpleNamespace(timeout=0.3, suspect=None, late=[2], cause="")  # a late peer that is never named
    assert _silence(never) is None and _silence(None) is None


def _phases(shared: Path) -> dict[int, dict]:
    return agent_status.read(shared, "t")


def _wait(predicate, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def agents(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    settings = AgentConfig(str(shared), secret_file=str(job_secret.create(shared)), scheme=Scheme("xor", AGENTS),
                           rounds=0, interval=0.2, nice=0, loss_timeout=LOSS_S).to_json()
    procs = []
    for i in range(AGENTS):
        root = tmp_path / f"node{i}"
        root.mkdir()
        env = {**os.environ, "HPCFT_STORE_ROOT": str(root), "HPCFT_EVENT_DIR": str(shared / "events")}
        argv = [sys.executable, "-m", "hpcft.agent", "--settings", settings, "--job-id", "beat", "--slot", str(i),
                "--slots", str(AGENTS), "--tag", "t"]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    yield shared, procs
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
        p.communicate()


def test_a_frozen_peer_is_named_after_the_loss_timeout_and_a_short_pause_is_not(agents):
    shared, procs = agents
    _wait(lambda: [r.get("phase") for r in _phases(shared).values()].count(agent_status.PROTECTING) == AGENTS,
          "every agent to protect", 60)
    # slow but alive: paused for a third of the timeout, then a whole timeout of rounds
    procs[2].send_signal(signal.SIGSTOP)
    time.sleep(LOSS_S / 3)
    procs[2].send_signal(signal.SIGCONT)
    resumed = time.time()
    time.sleep(LOSS_S + 1)
    st = _phases(shared)
    assert all(r["phase"] == agent_status.PROTECTING and r["time"] > resumed for r in st.values()), st
    assert not [e for e in events.read(shared / "events") if e["event"] == "peer_silent"]
    # frozen: its sockets stay open, only the heartbeats stop
    procs[2].send_signal(signal.SIGSTOP)
    frozen = time.time()
    _wait(lambda: all(_phases(shared)[s].get("phase") == agent_status.FAILED for s in (0, 1)),
          "the survivors to name the frozen peer", 10 * LOSS_S + 30)
    st = _phases(shared)
    for s in (0, 1):
        assert st[s]["peer_slot"] == 2 and st[s]["found_by"] == "heartbeat (silent)", st[s]
        assert st[s]["silent_s"] > LOSS_S and "silent" in st[s]["error"], st[s]
    silent = [e for e in events.read(shared / "events") if e["event"] == "peer_silent"]
    assert {e["slot"] for e in silent} == {0, 1} and {e["peer_slot"] for e in silent} == {2}, silent
    assert all(e["time"] - frozen >= LOSS_S for e in silent), silent  # never before the timeout
    for p in procs[:2]:
        assert p.wait(30) == 1  # failed, as after a closed connection


_PEER = """
import sys, time
from hpcft.agent.transport import secret
from hpcft.agent.transport.heartbeat import Heartbeat
beat = Heartbeat(1, 2, secret.load(sys.argv[2]), sys.argv[1], timeout=60.0, on_silent=lambda *a: None)
print("up", flush=True)
if sys.stdin.readline().strip() == "close":
    beat.close()
    print("closed", flush=True)
time.sleep(3600)
"""


@pytest.mark.parametrize("how", ["killed", "closed"])
def test_a_beat_connection_closed_without_a_goodbye_is_a_loss_at_once_an_orderly_close_is_not(tmp_path, how):
    """A killed agent's sockets close with it: named at once (`closed`), long before a 60 s loss timeout could name it
    silent; a peer that closes its heartbeat (asked to stop, done, unwinding a failure) says goodbye first."""
    import threading

    from hpcft.agent.transport.heartbeat import Heartbeat

    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    secret = job_secret.create(shared)
    peer = subprocess.Popen([sys.executable, "-c", _PEER, str(shared), str(secret)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    named: list[int] = []
    made: list[Heartbeat] = []
    joiner = threading.Thread(target=lambda: made.append(Heartbeat(
        0, 2, job_secret.load(secret), shared, timeout=60.0, on_silent=lambda *a: named.append(-1),
        on_closed=named.append)))
    joiner.start()
    try:
        assert peer.stdout.readline().strip() == "up"
        joiner.join(60)
        beat = made[0]
        _wait(lambda: beat.heard[1] > 0 and not named, "the first beats", 10)
        if how == "killed":
            peer.kill()
            _wait(lambda: named, "the killed peer to be named", 30)
            assert named == [1] and beat.suspect[0] == 1 and beat.cause == "closed"
        else:
            peer.stdin.write("close\n")
            peer.stdin.flush()
            assert peer.stdout.readline().strip() == "closed"
            _wait(lambda: 1 in beat.closed, "the goodbye", 30)
            time.sleep(3 * beat.period)
            assert named == [] and beat.suspect is None
    finally:
        peer.kill()
        peer.communicate()
        for b in made:
            b.close()


def test_a_silent_peer_is_named_at_its_deadline_not_at_the_next_beat():
    """Pure timing (a fake clock): the loop wakes at the earliest deadline of a watched peer, or at the next beat."""
    from hpcft.agent.transport.heartbeat import late_peers, next_wake, silent_peer

    limit = LOSS_S + period_for(LOSS_S)
    heard = {1: 10.0, 2: 11.0}
    assert next_wake(heard, now=12.0, limit=limit, beat_at=12.3, skip=()) == 12.3  # a beat comes first
    assert next_wake(heard, now=13.2, limit=limit, beat_at=13.5, skip=()) == pytest.approx(10.0 + limit)
    assert next_wake(heard, now=13.2, limit=limit, beat_at=13.5, skip={1}) == 13.5  # closed or unread: not watched
    assert next_wake(heard, now=20.0, limit=limit, beat_at=20.3, skip=()) == 20.0  # overdue: at once, never before now
    assert silent_peer(heard, 9.99 + limit, limit, ()) is None  # within the limit: not yet
    assert silent_peer(heard, 10.01 + limit, limit, ()) == 1 and silent_peer(heard, 10.01 + limit, limit, {1}) is None
    # late: silent past half the limit, probed ahead by the supervisor
    assert late_peers(heard, 9.99 + limit / 2, limit, ()) == []
    assert late_peers(heard, 10.01 + limit / 2, limit, ()) == [1]
    assert late_peers(heard, 11.01 + limit / 2, limit, ()) == [1, 2] and late_peers(heard, 20.0, limit, {1}) == [2]
