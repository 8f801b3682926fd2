"""One MPI rank of test_agent_mpimesh.py (started by mpirun): an MpiMesh whose slots run against the ranks, then the
scenario named in argv[1]; prints one JSON line of what it saw."""
import faulthandler
import json
import sys
import threading

import numpy as np

from hpcft.agent.transport.link import PeerGaveUp, TransportError
from hpcft.agent.transport.mpimesh import MpiMesh
from hpcft.agent.transport.mpiworld import world

faulthandler.dump_traceback_later(180, exit=True)  # a hang shows its stacks instead of a bare timeout
SIZE = int(sys.argv[2])
rank = world(30).rank
slot = SIZE - 1 - rank  # srun's task order need not be the slots'
mesh = MpiMesh(slot, SIZE, timeout=30, peers=[(slot + 1) % SIZE, (slot - 1) % SIZE])
out: dict = {"slot": slot}


def data(src: int, n: int) -> np.ndarray:
    return np.random.default_rng(src).integers(0, 256, n, dtype=np.uint8)


try:
    if sys.argv[1] == "agree":
        out["gather"] = mesh.allgather({"s": slot})
        out["min"] = mesh.allreduce(slot, min)
        out["exchange"] = {str(k): v for k, v in mesh.exchange([(slot + 1) % SIZE, (slot - 1) % SIZE], slot).items()}
        out["long"] = len(mesh.allgather("x" * 100_000)[0])  # a header past the first message
    elif sys.argv[1] == "bulk":
        dst, src = (slot + 1) % SIZE, (slot - 1) % SIZE
        big = data(slot, 3 * (1 << 20) + 12345)  # pieces spanning parts: a small head, the data, a tail
        parts = [big[:100], big[100:-7], big[-7:]]
        sender = threading.Thread(target=lambda: [mesh.send(dst, {"n": i}, parts) for i in range(2)])
        sender.start()
        header, whole = mesh.recv(src)
        ch = mesh.channel(src)
        h2, plen = ch.recv_header()
        got = np.empty(plen, dtype=np.uint8)
        for lo, hi in [(0, 5), (5, 1 << 20), ((1 << 20), (1 << 20) + 3), ((1 << 20) + 3, plen)]:  # odd slices
            ch.recv_payload(got[lo:hi])
        sender.join()
        want = data(src, big.size)
        out["ok"] = [header["n"], h2["n"], bool(np.array_equal(whole, want)), bool(np.array_equal(got, want))]
    elif sys.argv[1] == "give_up":
        if slot == 0:
            mesh.give_up(TransportError("slot 0 lost slot 2 (a test)"))  # as a failing round would
            out["gave_up"] = True
        else:
            try:
                mesh.allgather(slot)
            except PeerGaveUp as exc:
                out["peer_gave_up"] = exc.peer_slot
            except TransportError as exc:
                out["error"] = [type(exc).__name__, exc.peer_slot]
finally:
    mesh.close()
print("OUT" + json.dumps(out), flush=True)
