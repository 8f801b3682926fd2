"""One simulated node agent of `hpcft bench scale` (`python -m hpcft.bench.scale_agent '{"slot": …}'`, its settings
as one JSON object): the real mesh, heartbeats, directory and all-gather code on a loopback address of its own, with
an empty store. It says `ready` once imported, forms its meshes when told `go` (stdin), runs the agreement rounds,
measures its heartbeat traffic over a quiet window and prints one JSON line of what it measured."""
from __future__ import annotations

import json
import os
import socket
import struct
import sys
import time
from types import SimpleNamespace

from hpcft.agent.transport import secret as job_secret
from hpcft.agent.protection.bundle import both
from hpcft.agent.transport.heartbeat import Heartbeat
from hpcft.agent.transport.mesh import Mesh
from hpcft.agent.protection.placement import Scheme, plan
from hpcft.agent.transport.rendezvous import Rendezvous

_TCP_BYTES = struct.Struct("QQ")  # struct tcp_info: tcpi_bytes_acked, tcpi_bytes_received (Linux >= 4.1)
_TCP_BYTES_AT = 120


def tcp_bytes(sock: socket.socket) -> tuple[int, int] | None:
    """(payload bytes this socket sent and the peer acknowledged, payload bytes received), from the kernel's
    TCP_INFO; None where the kernel does not report them."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    except OSError:
        return None
    if len(info) < _TCP_BYTES_AT + _TCP_BYTES.size:
        return None
    return _TCP_BYTES.unpack_from(info, _TCP_BYTES_AT)


def socket_fds() -> int:
    """Open socket descriptors of this process (/proc/self/fd)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return count


def rss_mb() -> float:
    """This process's resident memory now (/proc/self/statm; ru_maxrss would count the parent's pages at fork)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _sent(mesh: Mesh) -> int:
    return sum(ch.sent for ch in mesh.peers.values())


def _traffic(beat: Heartbeat) -> tuple[int, int] | None:
    got = [tcp_bytes(ch.sock) for ch in beat.mesh.peers.values()]
    if any(g is None for g in got):
        return None
    return sum(g[0] for g in got), sum(g[1] for g in got)


def main() -> int:
    # slot, slots, host (this agent's loopback address: its 'node'), directory, secret, group, rounds, window, timeout
    args = SimpleNamespace(loss_timeout=60.0, **json.loads(sys.argv[1]))
    secret = job_secret.load(args.secret)
    placement = plan(args.slots, Scheme("xor", group=args.group) if args.slots >= args.group else Scheme("none"))
    meet = Rendezvous(args.directory, secret)
    before = socket_fds()
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    cpu0 = time.process_time()
    mesh = Mesh(args.slot, args.slots, secret, meet, host=args.host, bind=args.host, timeout=args.timeout, tag="s",
                peers=placement.exchange_peers(args.slot))
    silent: list[int] = []
    beat = Heartbeat(args.slot, args.slots, secret, meet, timeout=args.loss_timeout, host=args.host, bind=args.host,
                     tag="s", join_timeout=args.timeout, on_silent=lambda peer, s: silent.append(peer)) \
        if args.slots > 1 else None
    formed, setup_cpu = time.monotonic(), time.process_time() - cpu0
    sockets = socket_fds() - before
    agree, agree_cpu, gather, gather_cpu = [], [], [], []
    agree_bytes = gather_bytes = 0
    for r in range(args.rounds):
        held = list(range(r, r + 2 + args.slot % 2))  # the steps this agent holds, as a protect round agrees on them
        t0, c0, b0 = time.monotonic(), time.thread_time(), _sent(mesh)
        common = mesh.allreduce(held, both)
        agree.append(time.monotonic() - t0)
        agree_cpu.append(time.thread_time() - c0)
        t0, c0, b1 = time.monotonic(), time.thread_time(), _sent(mesh)
        got = mesh.allgather({"held": held, "slot": args.slot})
        gather.append(time.monotonic() - t0)
        gather_cpu.append(time.thread_time() - c0)
        agree_bytes, gather_bytes = b1 - b0, _sent(mesh) - b1
        if common != [r, r + 1] or len(got) != args.slots or any(v["slot"] != j for j, v in enumerate(got)):
            raise SystemExit(f"slot {args.slot}: the agreement of round {r} is wrong: {common}, {got}")
    mesh.allgather(None)  # everyone done agreeing: the window is heartbeats only
    first, w0 = (_traffic(beat), time.monotonic()) if beat else (None, time.monotonic())
    time.sleep(args.window)
    last, window = (_traffic(beat) if beat else None), time.monotonic() - w0
    beat_tx = beat_rx = None
    if first is not None and last is not None:
        beat_tx, beat_rx = (last[0] - first[0]) / window, (last[1] - first[1]) / window
    mesh.allgather(None)  # nobody closes while another still measures
    print(json.dumps({"slot": args.slot, "formed": formed, "setup_cpu_s": setup_cpu, "agree_s": agree,
                      "agree_cpu_s": agree_cpu, "gather_s": gather, "gather_cpu_s": gather_cpu,
                      "agree_bytes": agree_bytes, "gather_bytes": gather_bytes, "sockets": sockets,
                      "data_peers": len(mesh.peers), "beat_peers": len(beat.mesh.peers) if beat else 0,
                      "exchange_peers": len(placement.exchange_peers(args.slot)),
                      "beat_tx_Bps": beat_tx, "beat_rx_Bps": beat_rx, "silent": silent,
                      "rss_mb": rss_mb()}), flush=True)
    if beat is not None:
        beat.close()
    mesh.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
