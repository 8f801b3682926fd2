"""The agents' mesh at scale on real sockets (threads on loopback): each agent connects only to the slots it exchanges
bulk data with plus its overlay, the all-gather over the overlay gives every agent every value, a dead agent fails
every survivor naming it, and the rendezvous goes through the directory service (clear errors when it cannot)."""
import operator
import threading

import pytest

from hpcft.agent.protection.bundle import both
from hpcft.agent.transport.mesh import Mesh, overlay
from hpcft.agent.protection.placement import Scheme, plan
from hpcft.agent.transport.rendezvous import Directory, Rendezvous
from hpcft.agent.transport.tcp import TransportError

SECRET = b"m" * 64


def _together(size: int, fn) -> list:
    """fn(slot) for every slot at once (a collective), each one's result or exception."""
    out: list = [None] * size

    def one(slot: int) -> None:
        try:
            out[slot] = fn(slot)
        except TransportError as exc:
            out[slot] = exc

    threads = [threading.Thread(target=one, args=(s,)) for s in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def _meshes(size: int, rendezvous, peers=lambda slot: ()) -> list[Mesh]:
    made = _together(size, lambda s: Mesh(s, size, SECRET, rendezvous, host="127.0.0.1", bind="127.0.0.1",
                                          timeout=60, tag="m", peers=peers(s)))
    assert all(isinstance(m, Mesh) for m in made), made
    return made


@pytest.mark.parametrize("size", range(1, 10))
def test_the_overlay_all_gather_gives_every_agent_every_value(tmp_path, size):
    meshes = _meshes(size, tmp_path)  # slot 0 serves the directory, its address in one file
    try:
        values = [{"slot": s, "steps": list(range(s))} for s in range(size)]
        assert _together(size, lambda s: meshes[s].allgather(values[s])) == [values] * size
        assert _together(size, lambda s: meshes[s].allgather(s * 10)) == [[s * 10 for s in range(size)]] * size
        held = [list(range(s % 3, 20)) for s in range(size)]  # the steps each holds: every one holds 2..19
        assert _together(size, lambda s: meshes[s].allreduce(held[s], both)) == [list(range(min(2, size - 1), 20))] * size
        assert _together(size, lambda s: meshes[s].allreduce(s != 4, operator.and_)) == [size <= 4] * size
        for m in meshes:
            assert sorted(m.peers) == overlay(m.slot, size)
            assert len(m.peers) <= 2 * (size - 1).bit_length()
    finally:
        for m in meshes:
            m.close()


@pytest.mark.parametrize("scheme", [Scheme("xor", group=4), Scheme("rs", group=5, losses=2),
                                    Scheme("partner", distance=3), Scheme("none")])
def test_connections_are_the_exchange_peers_plus_the_overlay(scheme):
    size = 13
    placement = plan(size, scheme)
    served = Directory(SECRET)
    meshes = _meshes(size, Rendezvous(served.address, SECRET), placement.exchange_peers)
    try:
        for m in meshes:
            bulk = placement.exchange_peers(m.slot)
            assert set(m.peers) == bulk | set(overlay(m.slot, size))
            assert len(m.peers) <= len(bulk) + 2 * (size - 1).bit_length()
            if scheme.name in ("xor", "rs"):
                assert bulk == set(placement.set_of(m.slot).members) - {m.slot}
        assert _together(size, lambda s: meshes[s].allgather(s)) == [list(range(size))] * size
        got = _together(size, lambda s: meshes[s].exchange(placement.exchange_peers(s), s * 3))
        assert got == [{j: j * 3 for j in placement.exchange_peers(s) | {s}} for s in range(size)]
    finally:
        for m in meshes:
            m.close()
        served.close()


def test_a_dead_agent_fails_every_survivor_naming_it(tmp_path):
    size = 8
    meshes = _meshes(size, tmp_path)
    try:
        assert _together(size, lambda s: meshes[s].allgather(s))[0] == list(range(size))
        meshes[5].close()  # its process died: its sockets close (slot 0's directory stays up)
        survivors = [s for s in range(size) if s != 5]
        got = _together(len(survivors), lambda i: meshes[survivors[i]].allgather("next"))
        assert all(isinstance(e, TransportError) and e.peer_slot == 5 for e in got), got
    finally:
        for m in meshes:
            m.close()


def test_an_unreachable_directory_is_a_clear_error():
    served = Directory(SECRET)
    address = served.address
    served.close()
    with pytest.raises(TransportError, match="cannot reach the agents' directory at 127.0.0.1"):
        Mesh(1, 2, SECRET, Rendezvous(address, SECRET), host="127.0.0.1", bind="127.0.0.1", timeout=5, tag="x")


def test_a_slot_that_never_registers_is_named():
    served = Directory(SECRET)
    try:
        with pytest.raises(TransportError, match=r"slots \[0\] did not register") as err:
            Mesh(1, 2, SECRET, Rendezvous(served.address, SECRET), host="127.0.0.1", bind="127.0.0.1", timeout=1,
                 tag="x")
        assert err.value.peer_slot == 0
    finally:
        served.close()


def test_the_directory_is_tried_at_each_of_its_addresses():
    served = Directory(SECRET, host="127.0.0.2,127.0.0.1", bind="127.0.0.1")  # nothing listens on 127.0.0.2
    try:
        meet = Rendezvous(served.address, SECRET)
        assert meet.meet("t", 0, "127.0.0.1:1", [], 5) == {}
        assert meet.address == f"127.0.0.1:{served.listener.port}"  # the one that answered, kept
    finally:
        served.close()
