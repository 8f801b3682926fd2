"""Agent transport on real sockets: mutual HMAC handshake, strangers refused and logged, byte-exact
payloads into the caller's buffer; the job secret file; the bandwidth cap."""
import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from hpcft import events
from hpcft.agent.transport import secret as job_secret
from hpcft.agent.transport.throttle import Throttle, cpu_cores
from hpcft.agent.transport.tcp import ACCEPTED, MAGIC, NONCE, AuthError, Listener, TransportError, connect
from hpcft.errors import ConfigError

SECRET = b"s" * 64


@pytest.fixture
def event_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCFT_EVENT_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def listener():
    lst = Listener(SECRET, host="127.0.0.1")
    yield lst
    lst.close()


def test_payload_arrives_byte_identical_into_the_callers_buffer(listener):
    data = np.random.default_rng(1).integers(0, 256, (9 << 20) + 3, dtype=np.uint8)
    with ThreadPoolExecutor(1) as pool:
        server = pool.submit(listener.accept, 10)
        client = connect(SECRET, "127.0.0.1", listener.port)
        peer = server.result()
    into = np.zeros(data.size + 100, dtype=np.uint8)
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(client.send, {"kind": "piece", "step": 7}, data)
        header, got = peer.recv(into=into)
        sent.result()
    assert header == {"kind": "piece", "step": 7}
    assert got.tobytes() == data.tobytes()
    assert np.shares_memory(got, into)
    peer.send({"kind": "ack"})
    assert client.recv()[0] == {"kind": "ack"}
    client.close()
    peer.close()


def test_stranger_with_another_secret_is_refused_and_logged(listener, event_dir):
    with ThreadPoolExecutor(1) as pool:
        server = pool.submit(listener.accept, 10)
        with pytest.raises(AuthError, match="refused this agent: it does not accept our job secret"):
            connect(b"x" * 64, "127.0.0.1", listener.port)  # told so, not left with a closed connection
        good = connect(SECRET, "127.0.0.1", listener.port)
        peer = server.result()  # the stranger was skipped, the job's peer accepted
    assert listener.refused == 1
    refused = [e for e in events.read(event_dir) if e["event"] == "peer_refused"]
    assert len(refused) == 1 and refused[0]["reason"] == "wrong job secret"
    assert refused[0]["port"] == listener.port
    good.close()
    peer.close()


def test_garbage_client_is_refused_and_logged(listener, event_dir):
    with ThreadPoolExecutor(1) as pool:
        server = pool.submit(listener.accept, 10)
        with socket.create_connection(("127.0.0.1", listener.port)) as raw:
            raw.recv(len(MAGIC) + NONCE)
            raw.sendall(b"GET / HTTP/1.0\r\n\r\n" + b"x" * 100)
            try:
                assert raw.recv(10) == b""  # closed on us
            except ConnectionResetError:
                pass  # closed on us with our garbage unread
        good = connect(SECRET, "127.0.0.1", listener.port)
        server.result().close()
    good.close()
    assert [e["reason"] for e in events.read(event_dir) if e["event"] == "peer_refused"] == \
        ["not an hpcft agent (bad greeting)"]


def test_client_refuses_a_server_without_the_secret(event_dir):
    fake = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = fake.accept()
        conn.sendall(MAGIC + os.urandom(NONCE))
        conn.recv(1024)
        conn.sendall(ACCEPTED + b"\0" * 32)
        conn.close()

    t = threading.Thread(target=serve)
    t.start()
    with pytest.raises(AuthError, match="does not hold this job's secret"):
        connect(SECRET, "127.0.0.1", fake.getsockname()[1])
    t.join()
    fake.close()
    assert any(e["event"] == "peer_refused" for e in events.read(event_dir))


def test_secret_file_is_0600_kept_on_relaunch_and_refused_when_open(tmp_path):
    path = job_secret.create(tmp_path)
    assert path.stat().st_mode & 0o777 == 0o600
    first = job_secret.load(path)
    assert len(first) == 64
    assert job_secret.create(tmp_path) == path and job_secret.load(path) == first
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="mode 0600"):
        job_secret.load(path)
    with pytest.raises(ConfigError, match="HPCFT_SECRET_FILE"):
        job_secret.load(None)


def test_throttle_waits_for_the_bytes_over_the_cap():
    now = [0.0]
    slept = []
    throttle = Throttle(100.0, burst=100, clock=lambda: now[0], sleep=lambda s: (slept.append(s), now.__setitem__(0, now[0] + s)))
    throttle.take(100)  # the burst
    throttle.take(50)
    throttle.take(50)
    assert sum(slept) == pytest.approx(1.0)
    Throttle(None).take(1 << 40)  # no cap, no wait


def test_cpu_cap_waits_until_the_cpu_spent_fits_the_share():
    now, cpu, slept = [0.0], [0.0], []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    throttle = Throttle(None, clock=lambda: now[0], sleep=sleep, cpu=0.5, cpu_clock=lambda: cpu[0])
    cpu[0] += 1.5  # a pass spent 1.5 core-s at once: 0.5 of burst, then 1 core-s over the cap = 2 s at 0.5 cores
    throttle.take(1)
    assert slept == [pytest.approx(2.0)]
    now[0] += 10.0  # ten idle seconds in which 2 core-s went elsewhere (rounds, status): under the cap, no debt
    cpu[0] += 2.0
    throttle.take(1)
    assert len(slept) == 1
    throttle.release()  # a drain: the trainers stopped, the caps are lifted for good
    cpu[0] += 100.0
    throttle.take(1 << 40)
    assert len(slept) == 1
    with pytest.raises(ConfigError, match="between 0 and 1"):
        cpu_cores(1.5)
    assert cpu_cores(0.5) == pytest.approx(len(os.sched_getaffinity(0)) / 2)
    assert cpu_cores(0.5, 0.01) == 0.01  # --cpu-cores wins over the share
    with pytest.raises(ConfigError, match="number of cores"):
        cpu_cores(0.5, -1)


def test_work_the_trainers_wait_for_is_not_held_to_the_cpu_cap_nor_billed_to_the_rounds_after_it():
    """CI: a rebuild's CPU, capped at 1 % of a core, took seconds of the recovery, and its debt then kept the agents
    from protecting anything for the rest of a run."""
    now, cpu, slept = [0.0], [0.0], []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    throttle = Throttle(1000.0, burst=1000, clock=lambda: now[0], sleep=sleep, cpu=0.01, cpu_clock=lambda: cpu[0])
    with throttle.uncapped():
        cpu[0] += 5.0  # a rebuild: 5 core-s
        throttle.take(1000)
        assert slept == []
        throttle.take(2000)  # the byte cap, a share of the network, still holds: 2 s at 1000 B/s
        assert slept == [pytest.approx(2.0)]
    cpu[0] += 0.01  # the first round afterwards: within both buckets, as after an idle spell
    throttle.take(1000)
    assert len(slept) == 1 and (throttle.cpu, throttle.rate) == (0.01, 1000.0)
    now[0] += 1.0
    cpu[0] += 0.02  # 20 ms in a second that accrued 10: 1 s at 0.01 cores, as ever
    throttle.take(0)
    assert slept[1:] == [pytest.approx(1.0)]
    with throttle.uncapped():
        throttle.release()  # a drain meanwhile: the caps stay lifted
    assert (throttle.cpu, throttle.rate) == (0.0, 0.0)


def test_idle_and_slow_drip_clients_delay_no_peer(listener, event_dir):
    """50 clients that connect and send nothing and 50 that send a byte now and then stay open while 8 peers of the
    job connect one after another: each handshake completes within 1 s (before, each stalled client held the accept
    path for up to 10 s per byte)."""
    idle = [socket.create_connection(("127.0.0.1", listener.port)) for _ in range(50)]
    drip = [socket.create_connection(("127.0.0.1", listener.port)) for _ in range(50)]
    stop = threading.Event()

    def dripping() -> None:
        while not stop.wait(0.5):
            for s in drip:
                try:
                    s.send(b"H")
                except OSError:
                    pass

    dripper = threading.Thread(target=dripping)
    dripper.start()
    try:
        with ThreadPoolExecutor(1) as pool:
            for _ in range(8):
                server = pool.submit(listener.accept, 1.0)
                client = connect(SECRET, "127.0.0.1", listener.port, timeout=1.0)
                peer = server.result()  # accept(1.0) raises TransportError if the handshake took longer
                client.send({"n": 1})
                assert peer.recv()[0] == {"n": 1}
                client.close()
                peer.close()
    finally:
        stop.set()
        dripper.join()
        for s in idle + drip:
            s.close()


def test_a_stalled_handshake_is_refused_at_its_deadline(event_dir):
    lst = Listener(SECRET, host="127.0.0.1", handshake_s=0.5)
    try:
        with socket.create_connection(("127.0.0.1", lst.port)) as raw:
            raw.settimeout(10)
            assert raw.recv(len(MAGIC) + NONCE).startswith(MAGIC)
            for _ in range(3):  # a byte now and then never buys more time than the one deadline
                raw.send(b"H")
                threading.Event().wait(0.2)
            try:
                assert raw.recv(10) == b""  # closed on us
            except ConnectionResetError:
                pass
    finally:
        lst.close()
    assert [e["reason"] for e in events.read(event_dir) if e["event"] == "peer_refused"] == \
        ["no complete handshake within 0.5 s"]


def _pair(listener):
    with ThreadPoolExecutor(1) as pool:
        server = pool.submit(listener.accept, 10)
        client = connect(SECRET, "127.0.0.1", listener.port)
        return client, server.result()


def test_an_authenticated_peers_oversized_length_is_a_transport_error(listener):
    import struct

    client, peer = _pair(listener)
    head = b"{}"
    client.sock.sendall(struct.pack("!IQ", len(head), 1 << 62) + head)  # a payload no node could hold
    with pytest.raises(TransportError, match="more than this node's free memory"):
        peer.recv()
    client.close()
    peer.close()


def test_a_deeply_nested_header_is_a_transport_error(listener):
    import struct

    client, peer = _pair(listener)
    head = b"[" * 200_000 + b"]" * 200_000
    client.sock.sendall(struct.pack("!IQ", len(head), 0) + head)
    with pytest.raises(TransportError, match="nested too deeply"):
        peer.recv()
    client.close()
    peer.close()
