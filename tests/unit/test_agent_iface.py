"""The node agents bind to the high-speed interface (hsn0 on Frontier), and fall back, with a warning event, on a
node that has none."""
import socket

from hpcft import events
from hpcft.agent.transport.iface import choose, iface_address
from hpcft.agent.transport.tcp import Listener, connect


def test_a_named_interface_gives_its_address_for_both_reach_and_bind(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCFT_EVENT_DIR", str(tmp_path))
    assert iface_address("lo") == "127.0.0.1"
    assert choose("lo", "auto") == ("127.0.0.1", "127.0.0.1")
    assert events.read(tmp_path) == []


def test_a_missing_interface_falls_back_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCFT_EVENT_DIR", str(tmp_path))
    assert iface_address("hsn9") is None
    assert choose("hsn9", "127.0.0.1", slot=3) == ("127.0.0.1", "0.0.0.0")
    (event,) = events.read(tmp_path)
    assert event["event"] == "agent_iface_missing" and event["level"] == "WARNING"
    assert event["iface"] == "hsn9" and event["fallback"] == "127.0.0.1" and event["slot"] == 3
    assert choose(None, "auto") == (socket.gethostbyname(socket.gethostname()), "0.0.0.0")
    assert len(events.read(tmp_path)) == 1  # no interface asked for: nothing to warn about


def test_an_agent_bound_to_the_interface_is_reached_there():
    secret = b"s" * 32
    host, bind = choose("lo", "auto")
    listener = Listener(secret, host=bind)
    try:
        assert listener.sock.getsockname()[0] == "127.0.0.1"
        ch = connect(secret, host, listener.port, timeout=10)
        peer = listener.accept(10)
        ch.send({"hello": 1})
        assert peer.recv()[0] == {"hello": 1}
        ch.close()
        peer.close()
    finally:
        listener.close()
