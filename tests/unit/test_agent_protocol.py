"""What an authenticated peer sends is checked field by field: a malformed hello, a hello that claims another slot's
identity or one already connected, and a malformed message in an agreement, an exchange or a protection/rebuild
transfer are each a TransportError that names the peer (its slot where it has one), raised promptly on every side
involved, never a hang nor a raw KeyError/ValueError/TypeError. Real meshes on loopback, fakes on raw channels."""
import json
import operator
import struct
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from test_agent_mesh import SECRET, _meshes  # tests/unit is on sys.path (pytest's rootdir insertion)

from hpcft.agent.agent import STEPS
from hpcft.agent.protection.bundle import both, parse
from hpcft.agent.transport.link import PeerGaveUp
from hpcft.agent.transport.mesh import Mesh
from hpcft.agent.protection.flush import VOTE
from hpcft.agent.protection.flush import combine as persist_combine
from hpcft.agent.protection.flush import vote as persist_vote
from hpcft.agent.protection.placement import Scheme, plan
from hpcft.agent.protection.protect import _partner, record_slot
from hpcft.agent.protection.rebuild import _receive
from hpcft.agent.transport.rendezvous import Directory, Rendezvous
from hpcft.agent.transport.tcp import TransportError, connect
from hpcft.errors import IntegrityError

PROMPT_S = 10.0  # "promptly": every side has its error well within this


def _background(fn):
    """fn() in a daemon thread; the returned wait(timeout) is its result or exception, or "hung" if still running."""
    out: list = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 (the test inspects whatever it raised)
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def wait(timeout: float):
        thread.join(timeout)
        return out[0] if out else "hung"
    return wait


def _mesh(slot: int, size: int, served: Directory, made: list, then=None):
    """A background Mesh of `slot` (kept in `made` for closing), then `then(mesh)` if given."""
    def run():
        m = Mesh(slot, size, SECRET, Rendezvous(served.address, SECRET), host="127.0.0.1", bind="127.0.0.1",
                 timeout=PROMPT_S, tag="m")
        made.append(m)
        return then(m) if then else m
    return _background(run)


def _fake(served: Directory, slot: int, addr: str = "127.0.0.1:9"):
    """A raw authenticated channel to slot 0's listener, after registering at the directory as `slot`."""
    where = Rendezvous(served.address, SECRET).meet("m", slot, addr, [0], PROMPT_S)
    host, port = where[0].rsplit(":", 1)
    ch = connect(SECRET, host, int(port))
    ch.sock.settimeout(PROMPT_S)
    return ch


def _hello(slot, addr="127.0.0.1:9", **changed):
    return {"hello": slot, "tag": "m", "to": 0, "addr": addr, **changed}


@pytest.mark.parametrize("hello, named", [
    ({}, None),  # no field at all
    ({"tag": "m", "to": 0, "addr": "127.0.0.1:9"}, None),  # no slot
    (_hello("1"), None),  # a slot that is a string
    (_hello(True), None),  # a bool is no slot
    (_hello(1.0), None),  # nor a float
    (_hello(5), None),  # outside 0..1
    (_hello(1, tag="another launch"), 1),
    (_hello(1, to=3), 1),  # meant for another slot
])
def test_a_malformed_hello_is_a_transport_error_naming_the_peer_and_the_peer_is_told(hello, named):
    served, made = Directory(SECRET), []
    try:
        acceptor = _mesh(0, 2, served, made)
        fake = _fake(served, 1)
        fake.send(hello)
        err = acceptor(PROMPT_S)
        assert isinstance(err, TransportError), err
        assert err.peer_slot == named
        assert f":{fake.sock.getsockname()[1]}" in str(err)  # the peer's address, whatever it claimed
        with pytest.raises(PeerGaveUp, match="refused"):  # told, at once: not left waiting
            fake.recv()
        fake.close()
    finally:
        for m in made:
            m.close()
        served.close()


@pytest.mark.parametrize("spoof", [_hello(1), {"hello": 1, "tag": "m"}])
def test_a_hello_claiming_another_slots_identity_fails_every_side_promptly(spoof):
    """An impostor's `hello: 1` reaches slot 0 before slot 1's own: slot 0 refuses it (the address slot 1 registered
    is not the impostor's) and fails; slot 1, whose connection slot 0 never welcomed, fails too; nobody hangs."""
    served, made = Directory(SECRET), []
    try:
        acceptor = _mesh(0, 2, served, made, lambda m: m.allgather(0))
        impostor = _fake(served, 7)  # registered as a slot outside the mesh: only to learn slot 0's address
        impostor.send(spoof)
        time.sleep(0.3)  # the impostor's connection is queued at slot 0 before slot 1's
        genuine = _mesh(1, 2, served, made, lambda m: m.allgather(1))
        first, second = acceptor(PROMPT_S), genuine(PROMPT_S)
        assert isinstance(first, TransportError) and first.peer_slot == 1, first
        assert isinstance(second, TransportError) and second.peer_slot == 0, second
        with pytest.raises(PeerGaveUp, match="refused"):
            impostor.recv()
        impostor.close()
    finally:
        for m in made:
            m.close()
        served.close()


def test_a_second_connection_claiming_one_slot_is_refused_and_told():
    served, made = Directory(SECRET), []
    try:
        acceptor = _mesh(0, 3, served, made)
        Rendezvous(served.address, SECRET).meet("m", 2, "127.0.0.1:8", [0], PROMPT_S)  # slot 2 registered, absent
        first = _fake(served, 1)
        first.send(_hello(1))
        assert first.recv()[0] == {"welcome": 0}
        second = _fake(served, 1)  # the same slot again, same registered address
        second.send(_hello(1))
        err = acceptor(PROMPT_S)
        assert isinstance(err, TransportError) and err.peer_slot == 1 and "already" in str(err), err
        with pytest.raises(PeerGaveUp, match="refused"):
            second.recv()
        for ch in (first, second):
            ch.close()
    finally:
        for m in made:
            m.close()
        served.close()


def _vote() -> dict:
    return persist_vote(0, "idle", "", None, "abcd", None, [1, 2], [1, 2, 3], 2)


def _gather(m):
    return m.allgather(0)


def _reduce(m):
    return m.allreduce([1, 2], both)  # no shape: what `both` cannot take is caught all the same


@pytest.mark.parametrize("call, sent", [
    (_gather, {"allgather": 5, "round": 1}),  # not a list of [slot, value]
    (_gather, {"allgather": [["x", 1]], "round": 1}),  # a slot that is no integer
    (_gather, {"allgather": [[7, 1]], "round": 1}),  # a slot outside the sender's window
    (_gather, {"allgather": [[1, 1], [0, 0]], "round": 1}),  # more values than the round carries
    (_gather, {"allgather": [[1, 1]], "round": True}),  # a round that is a bool
    (_reduce, {"allreduce": 5, "round": 1}),  # not a list of steps
    (_reduce, {"allreduce": [[1]], "round": 1}),  # a list of lists
    # values checked against the shape the caller expects
    (lambda m: m.exchange({1}, 5, shape=int), {"exchange": "5"}),
    (lambda m: m.exchange({1}, 5, shape=int), {"exchanged": 5}),
    (lambda m: m.allgather({"held": [1]}, shape={"held": [int]}), {"allgather": [[1, {"held": ["1"]}]], "round": 1}),
    (lambda m: m.allgather({"held": [1]}, shape={"held": [int]}), {"allgather": [[1, {}]], "round": 1}),
    (lambda m: m.allreduce(True, operator.and_, shape=bool), {"allreduce": 1, "round": 1}),
    # the agents' own agreements: the steps held (agent.STEPS) and the flush's vote (persist.VOTE)
    (lambda m: m.allreduce([1, 2], both, shape=STEPS), {"allreduce": [1, -2], "round": 1}),
    (lambda m: m.allreduce(_vote(), persist_combine, shape=VOTE), {"allreduce": {**_vote(), "durable": "3"},
                                                                   "round": 1}),
    (lambda m: m.allreduce(_vote(), persist_combine, shape=VOTE), {"allreduce": {**_vote(), "failed": [[1]]},
                                                                   "round": 1}),
])
def test_a_malformed_round_or_value_is_a_transport_error_naming_the_sender(tmp_path, call, sent):
    meshes = _meshes(2, tmp_path)
    try:
        waiting = _background(lambda: call(meshes[0]))
        meshes[1].channel(0).send(sent)
        err = waiting(PROMPT_S)
        assert isinstance(err, TransportError) and err.peer_slot == 1, err
    finally:
        for m in meshes:
            m.close()


@pytest.mark.parametrize("header, payload", [
    ({"rebuild": 3, "bundle": "x", "record": -1, "meta": None}, b""),
    ({"rebuild": 3, "record": -1, "meta": None}, b""),
    ({"rebuild": 3, "bundle": 100, "record": -1, "meta": None}, b"abc"),  # announces more than it carries
    ({"rebuild": 3, "bundle": 3, "record": -1, "meta": [1]}, b"abc"),
    ({"rebuild": 2, "bundle": 3, "record": -1, "meta": None}, b"abc"),  # another step's
])
def test_a_malformed_rebuild_transfer_is_a_transport_error_naming_the_sender(tmp_path, header, payload):
    meshes = _meshes(2, tmp_path)
    try:
        waiting = _background(lambda: _receive(meshes[0], [(1, "set")], 3))
        meshes[1].send(0, header, [np.frombuffer(payload, dtype=np.uint8)])
        err = waiting(PROMPT_S)
        assert isinstance(err, TransportError) and err.peer_slot == 1, err
    finally:
        for m in meshes:
            m.close()


def test_a_partner_copy_of_another_step_is_a_transport_error(tmp_path):
    meshes = _meshes(2, tmp_path)
    placement = plan(2, Scheme("partner", distance=1))
    bundle = SimpleNamespace(step=3, size=8, piece=lambda lo, hi: [np.zeros(hi - lo, dtype=np.uint8)])
    (tmp_path / "protect").mkdir()
    slot = record_slot(tmp_path / "protect", 3)
    try:
        waiting = _background(lambda: _partner(meshes[0], placement, bundle, slot, {0: 8, 1: 8}))
        meshes[1].send(0, {"step": 99, "kind": "bundle"}, [np.ones(8, dtype=np.uint8)])
        err = waiting(PROMPT_S)
        assert isinstance(err, TransportError) and err.peer_slot == 1, err
    finally:
        slot.close()
        for m in meshes:
            m.close()


@pytest.mark.parametrize("ranks", [[{"rank": 0}], [7], "all", [{"rank": "0", "manifest_bytes": 0, "data_bytes": 0}]])
def test_a_bundle_whose_header_is_malformed_is_an_integrity_error(ranks):
    head = json.dumps({"step": 3, "ranks": ranks}).encode()
    with pytest.raises(IntegrityError, match="bundle of step 3"):
        parse(np.frombuffer(struct.pack("!Q", len(head)) + head, dtype=np.uint8), 3)
