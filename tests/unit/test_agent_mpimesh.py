"""The agents' MPI mesh: its pure parts (payload pieces, the slot ↔ rank map, the poller's pace) and four real MPI
ranks under mpirun (Open MPI over TCP on this machine) running the agreements, bulk messages read in odd slices, and
a give-up, with the slots in the reverse of the ranks' order."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hpcft.agent.transport.link import TransportError
from hpcft.agent.transport.mpilink import pieces
from hpcft.agent.transport.mpimesh import rank_of_slot
from hpcft.agent.transport.mpiworld import Poller
from hpcft.sandbox.config import OPEN_MPI_TCP_ENV

TASK = Path(__file__).with_name("mpi_mesh_task.py")


def test_pieces_cut_the_concatenation_at_fixed_offsets_copying_only_what_spans_parts():
    parts = [np.arange(3, dtype=np.uint8), np.arange(10, dtype=np.uint8) + 3, np.arange(2, dtype=np.uint8) + 13]
    out = list(pieces(parts, piece=4))
    assert [p.size for p in out] == [4, 4, 4, 3]
    assert np.array_equal(np.concatenate(out), np.arange(15, dtype=np.uint8))
    big = np.arange(9, dtype=np.uint8)
    assert all(np.shares_memory(p, big) for p in pieces([big], piece=4))  # one part: views, no copy
    assert list(pieces([np.empty(0, np.uint8)])) == []


def test_slots_map_to_ranks_only_when_each_slot_is_there_once():
    assert rank_of_slot([2, 0, 1], 3) == {2: 0, 0: 1, 1: 2}
    for bad in ([0, 0, 1], [0, 1], [0, 1, 3]):
        with pytest.raises(TransportError, match="one agent per active slot"):
            rank_of_slot(bad, 3)


def test_the_poller_keeps_pace_after_a_completion_backs_off_while_waiting_and_sleeps_when_nobody_waits():
    poll = Poller(first=1e-5, busy_max=1e-3)
    assert poll.next(completed=True, waited=True) == 0.0
    delays = [poll.next(completed=False, waited=True) for _ in range(10)]
    assert delays[0] == 1e-5 and delays == sorted(delays) and delays[-1] == 1e-3
    assert poll.next(completed=True, waited=True) == 0.0  # a completion: the next piece may be under way
    assert poll.next(completed=False, waited=False) is None  # only standing receives: no polling at all


def _mpirun(scenario: str, n: int = 4) -> list[dict]:
    if shutil.which("mpirun") is None:
        pytest.skip("no mpirun on this machine")
    pytest.importorskip("mpi4py")
    argv = ["mpirun", "-q", "-n", str(n), "--oversubscribe", sys.executable, str(TASK), scenario, str(n)]
    if os.geteuid() == 0:
        argv[1:1] = ["--allow-run-as-root"]
    done = subprocess.run(argv, env={**os.environ, **OPEN_MPI_TCP_ENV}, capture_output=True, text=True, timeout=240)
    # mpirun forwards the ranks' output in chunks, not lines: two ranks' records can share a line
    decode = json.JSONDecoder().raw_decode
    got = [decode(done.stdout, m.end() - 1)[0] for m in re.finditer(r"OUT\{", done.stdout)]
    assert len(got) == n, done.stdout[-3000:] + done.stderr[-3000:]
    return sorted(got, key=lambda o: o["slot"])


def test_agreements_over_mpi_match_the_tcp_mesh_s_answers():
    for o in _mpirun("agree"):
        s = o["slot"]
        assert o["gather"] == [{"s": j} for j in range(4)] and o["min"] == 0
        assert o["exchange"] == {str(j): j for j in {s, (s + 1) % 4, (s - 1) % 4}}
        assert o["long"] == 100_000  # a header longer than the frame's first message


def test_bulk_messages_arrive_byte_identical_whatever_slices_the_receiver_reads():
    assert all(o["ok"] == [0, 1, True, True] for o in _mpirun("bulk"))


def test_a_give_up_reaches_every_neighbour_as_the_tcp_notice_does():
    got = _mpirun("give_up")
    assert got[0] == {"slot": 0, "gave_up": True}
    assert all(o.get("peer_gave_up") == 0 for o in got[1:]), got  # the slot the one giving up names as lost
