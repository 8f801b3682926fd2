"""Slurm's node states sorted into lost (cannot run the job's tasks: the step stops) and closed (runs them, but gets
no new work: an admin's drain, `scontrol reboot ASAP`), hpcft/slurm/state.py; and the watch's node check that keeps
a closed node's step running and says so once (hpcft/launch/node/nodecheck.py). The integration test that drains a
running job's nodes is test_supervisor_requeue.py's durable-tier test."""
import subprocess

import pytest

import fake_probe  # tests/unit is on sys.path (pytest's rootdir insertion)

from hpcft.launch.node.nodecheck import NodeCheck
from hpcft.slurm import state as slurmstate

# as `scontrol show node -o` prints them (22.05: base state, then +FLAG…), and sinfo's short forms
LOST = ["DOWN", "DOWN+DRAIN", "IDLE+NOT_RESPONDING", "MIXED+NOT_RESPONDING", "down*", "idle*", "IDLE+POWERED_DOWN",
        "IDLE+POWERING_DOWN", "IDLE+POWERING_UP", "DOWN+REBOOT_ISSUED", "ALLOCATED+REBOOT_ISSUED", "FUTURE",
        "idle~", "idle%", "mix#", "DOWN+DRAIN+NOT_RESPONDING"]
CLOSED = ["MIXED+DRAIN", "ALLOCATED+DRAIN", "IDLE+DRAIN", "ALLOCATED+FAIL", "MIXED+REBOOT_REQUESTED",
          "ALLOCATED+DRAIN+REBOOT_REQUESTED", "MIXED+POWER_DOWN", "draining", "drained", "failing", "mix@",
          "ALLOCATED+DRAIN+INVALID_REG"]
OPEN = ["MIXED", "ALLOCATED", "IDLE", "ALLOCATED+COMPLETING", "MIXED+RESERVED", "IDLE+CLOUD", "UNKNOWN", "mix", ""]


@pytest.mark.parametrize("state", LOST)
def test_a_lost_state_is_lost_and_bad(state):
    assert slurmstate.is_lost(state) and slurmstate.is_bad(state)


@pytest.mark.parametrize("state", CLOSED)
def test_a_closed_state_is_bad_for_new_work_but_not_lost(state):
    assert slurmstate.is_closed(state) and slurmstate.is_bad(state) and not slurmstate.is_lost(state)


@pytest.mark.parametrize("state", OPEN)
def test_an_open_state_is_neither(state):
    assert not slurmstate.is_bad(state) and not slurmstate.is_closed(state)


class _Slurm:
    """Answers scontrol's `show job` and `show node` for a job on frontier0000[1-4] (a narrow unit test of reading
    Slurm's words; the real scontrol runs in the integration tests)."""

    def __init__(self, states: dict[str, str], nodelist: str = "frontier[00001-00004]", frozen: frozenset = frozenset()):
        self.states, self.nodelist, self.frozen, self.probed = states, nodelist, frozen, []

    def popen(self, argv, *, env=None, **kwargs):  # the probe's srun: a healthy node echoes its name
        self.probed.append(fake_probe.node_of(argv))
        return fake_probe.probe(argv, self.frozen, **kwargs)

    def run(self, argv, check=True):
        if argv[:3] == ["scontrol", "show", "job"]:
            out = f"JobId=7 JobState=RUNNING NodeList={self.nodelist} BatchFlag=1 Requeue=1 Restarts=0"
        else:
            out = "\n".join(f"NodeName={n} Arch=x86_64 State={s} Reason=hpcft [root@2026-12-03]"
                            for n, s in self.states.items() if n in argv[-1].split(","))
        return subprocess.CompletedProcess(argv, 0, out, "")


NODES = [f"frontier0000{i}" for i in range(1, 5)]


def test_health_sorts_the_nodes_and_a_node_gone_from_the_allocation_is_lost():
    slurm = _Slurm({"frontier00001": "MIXED+DRAIN", "frontier00002": "MIXED+NOT_RESPONDING",
                    "frontier00003": "MIXED", "frontier00004": "MIXED"}, nodelist="frontier[00001-00003]")
    health = slurmstate.node_health(slurm, "7", NODES)
    assert health.closed == {"frontier00001": "MIXED+DRAIN"}
    assert health.lost == {"frontier00002": "MIXED+NOT_RESPONDING",
                           "frontier00004": "left the allocation (state MIXED)"}
    assert slurmstate.bad_nodes(slurm, "7", NODES) == health.bad and len(health.bad) == 3


def test_the_watch_keeps_a_drained_node_says_so_once_and_a_check_after_a_failure_counts_it_bad():
    said: list[tuple[str, dict]] = []
    slurm = _Slurm(dict.fromkeys(NODES, "MIXED") | {"frontier00002": "MIXED+DRAIN"})
    check = NodeCheck(slurm, "7", {}, 5.0, lambda kind, **f: said.append((kind, f)))
    for _ in range(3):  # the watch's polls
        assert check.bad(NODES, probe=False, closed=False) == {}
    assert [(k, f["node"], f["state"]) for k, f in said] == [("node_closed", "frontier00002", "MIXED+DRAIN")]
    slurm.states["frontier00002"] = "MIXED+DRAIN+REBOOT_REQUESTED"  # a new state is said again
    assert check.bad(NODES, probe=False, closed=False) == {} and len(said) == 2
    assert check.bad(NODES, probe=True) == {"frontier00002": "MIXED+DRAIN+REBOOT_REQUESTED"}  # after a failure
    assert said[-1][0] == "node_bad" and check.closed_now == {"frontier00002": "MIXED+DRAIN+REBOOT_REQUESTED"}
    assert sorted(slurm.probed) == ["frontier00001", "frontier00003", "frontier00004"]  # the others are probed
    slurm.frozen = frozenset({"frontier00004"})  # a dead node Slurm has not marked yet hides behind no drain
    check.probe_timeout = 1.0
    assert check.bad(NODES, probe=True) == {"frontier00002": "MIXED+DRAIN+REBOOT_REQUESTED",
                                            "frontier00004": "probe did not answer within 1 s"}
    slurm.states["frontier00003"] = "DOWN+NOT_RESPONDING"  # lost stops the step, with or without closed
    assert check.bad(NODES, probe=False, closed=False) == {"frontier00003": "DOWN+NOT_RESPONDING"}
