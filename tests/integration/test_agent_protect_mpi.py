"""The protect pass of test_agent_protect.py with the agents as the four ranks of one mpirun (--transport mpi, mpi4py
on this machine's Open MPI over TCP). One protect run per scheme serves every case that only reads its result: the
parity (or partner copy) each node holds, and, on a copy of it, the rebuild of lost nodes. A stop ends agents blocked
on a frozen peer."""
import os
import signal
import time

import pytest
from protect_nodes import (NODES, Cluster, check_parity, check_partner, check_rebuild, copy_cluster, make_cluster,
                           mpi_log, mpi_result, run_agents, start_mpi_agents)

from hpcft.agent import status as agent_status
from hpcft.agent.protection.placement import Scheme
from hpcft.deps import available

pytestmark = pytest.mark.skipif(not available("mpi4py"), reason="mpi4py is not installed")
SCHEMES = {"xor": Scheme("xor", group=4), "rs": Scheme("rs", group=4, losses=2),
           "partner": Scheme("partner", distance=1)}
EXTRA = {"partner": {"lag_bound": 1}}  # kept to by the partner run: the CPU cap stays (check_partner)


@pytest.fixture(scope="module")
def protected(tmp_path_factory):
    """The cluster of each scheme after one protect run over MPI (tag: the scheme's name), made when first asked for
    and shared by the module's cases: {name: (cluster, the agents' results)}."""
    made: dict[str, tuple[Cluster, list]] = {}

    def get(name: str) -> tuple[Cluster, list]:
        if name not in made:
            cluster = make_cluster(tmp_path_factory.mktemp(f"protected-{name}"))
            made[name] = cluster, run_agents(cluster, SCHEMES[name], name, transport="mpi", **EXTRA.get(name, {}))
        return made[name]

    return get


@pytest.mark.parametrize("name", ["xor", "rs"])
def test_parity_on_every_node_is_exact_and_rebuilds_lost_nodes_over_mpi(protected, name):
    cluster, done = protected(name)
    check_parity(cluster, SCHEMES[name], done)


def test_partner_holds_an_exact_copy_of_its_neighbours_bundle_over_mpi(protected):
    cluster, done = protected("partner")
    check_partner(cluster, "partner", done)


@pytest.mark.parametrize("name,lost", [("xor", {1}), ("partner", {2}), ("rs", {0, 3})],
                         ids=["xor", "partner", "rs"])
def test_rebuild_puts_the_lost_nodes_snapshot_back_byte_identical_over_mpi(protected, tmp_path, name, lost):
    cluster, done = protected(name)
    assert [p.returncode for p in done] == [0] * NODES, "the protect run failed: see the parity or partner case"
    check_rebuild(copy_cluster(cluster, tmp_path / "copy"), SCHEMES[name], lost, tmp_path, transport="mpi")


def test_over_mpi_a_stop_ends_agents_blocked_on_a_frozen_peer(tmp_path):
    """No heartbeats (--loss-timeout 0): a frozen agent leaves its peers waiting on MPI messages that never come, yet
    the supervisor's stop ends them at once (no thread of theirs sits inside a blocking MPI call)."""
    cluster = make_cluster(tmp_path)
    shared = cluster.shared
    proc, logs = start_mpi_agents(cluster, Scheme("xor", group=4), "f", rounds=0, interval=0.1, loss_timeout=0)
    frozen = None
    try:
        deadline = time.monotonic() + 120
        while True:
            reports = agent_status.read(shared, "f")
            if len(reports) == NODES and all(r.get("protected") == 2 for r in reports.values()):
                break
            assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read() if proc.poll() else reports
            time.sleep(0.1)
        frozen = reports[2]["pid"]
        os.kill(frozen, signal.SIGSTOP)
        time.sleep(2.0)  # the others' next rounds now wait on slot 2
        assert all(agent_status.read(shared, "f")[i]["phase"] == agent_status.PROTECTING for i in (0, 1, 3))
        asked = time.monotonic()
        agent_status.request_stop(shared, "f")
        # each one's end: its mesh closed (no MPI_Finalize: the frozen one never gets there); mpirun is told to let
        # ranks exit without it, as srun does (start_mpi_agents), so one agent's exit does not cut a slower one's short
        while not all("event=mesh_mpi_closed" in mpi_log(logs, i, "err").read_text() for i in (0, 1, 3)):
            assert time.monotonic() < asked + 60, "the stop did not end the agents waiting on the frozen one"
            time.sleep(0.1)
        assert [agent_status.read(shared, "f")[i]["phase"] for i in (0, 1, 3)] == [agent_status.STOPPED] * 3
        while not all(mpi_log(logs, i, "rc").exists() for i in (0, 1, 3)):
            assert time.monotonic() < asked + 60, "a stopped agent did not exit"
            time.sleep(0.1)
        assert [mpi_result(logs, i).returncode for i in (0, 1, 3)] == [0] * 3
    finally:
        if frozen is not None:
            try:
                os.kill(frozen, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.kill()
        proc.wait()
