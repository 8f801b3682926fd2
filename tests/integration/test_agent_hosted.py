"""An elastic shrink's rebuild addressing, with real agent processes on this machine: slot 1's node is lost and no
node replaces it; slot 1's agent runs on slot 2's node (`--hosted`, a store of its own inside that node's) and
rebuilds slot 1's snapshot there from the others' bundles and parity, byte-identical, while slot 2's own agent and
ranks on the same node are untouched."""
import os
import subprocess
import sys

from protect_nodes import JOB, NODES, RANKS_PER_NODE, held, node_files
from test_agent_protect import cluster  # noqa: F401 (fixture)

from hpcft.agent.protection.placement import Scheme
from hpcft.agent.settings import AgentConfig
from hpcft.store import job_dir

SCHEME = Scheme("xor", group=4)


def _agents(roots, shared, secret, tag, hosted: dict[int, int] = {}, *extra):
    """One agent per slot, slot i on node roots[i], or on node roots[hosted[i]] with --hosted."""
    procs, settings = [], AgentConfig(str(shared), secret_file=str(secret), scheme=SCHEME).to_json()
    for i in range(NODES):
        root = roots[hosted.get(i, i)]
        env = {**os.environ, "HPCFT_STORE_ROOT": str(root), "HPCFT_EVENT_DIR": str(shared / "events")}
        argv = [sys.executable, "-m", "hpcft.agent", "--settings", settings, "--job-id", JOB, "--slot", str(i),
                "--slots", str(NODES), "--tag", tag, *extra, *(["--hosted"] if i in hosted else [])]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * NODES, [err[-2000:] for _, err in out]
    return [o for o, _ in out]


def test_a_lost_slot_is_rebuilt_on_a_survivor_beside_its_own_slot(cluster, tmp_path):
    roots, shared, secret = cluster
    _agents(roots, shared, secret, "p")
    lost = node_files(roots[1])
    record = held(roots[1], 2)[1].tobytes()
    own = node_files(roots[2])
    now = list(roots)
    now[1] = tmp_path / "gone"  # node 1 is lost with its memory; nobody replaces it
    out = _agents(now, shared, secret, "r", {1: 2}, "--rebuild")
    assert all("rebuilt=2" in o for o in out) and "here=True" in out[1]
    hosted = job_dir(roots[2], JOB) / "hosted-1"  # the stand-in's root, inside node 2's job store
    got = node_files(hosted)
    assert len(got) == 2 * RANKS_PER_NODE
    assert set(got) <= set(lost) and got == {k: lost[k] for k in got}  # manifests and data of step 2, identical
    assert held(hosted, 2)[1].tobytes() == record  # slot 1's protection record regenerated there too
    assert node_files(roots[2]) == own  # node 2's own ranks (4, 5) untouched, and only they are its own
