"""`hpcft run --broadcast-env` in the sandbox, Frontier-shaped: 3 nodes × 2 ranks, a Python environment packed once
into a cache, sbcast into each node's own disk (the sandbox mounts one per node at <sandbox>/local), unpacked and verified
there. The trainers run from their node's copy (sys.executable under it), a killed rank's cold relaunch too, ending
bit-identical to a run from the shared interpreter; a node whose broadcasting fails runs from the shared interpreter, said
in a `broadcast_env_failed` event, and the run still succeeds; the janitors remove every copy.

The environment broadcast is a small venv of its own (`small_env`), not the 1 GB test venv: what the broadcasting does is the
same for both (the bytes differ), and the test venv's pack, sbcast and unpack were most of the suite's time."""
import json
import os
import shutil
import signal
import sys
import sysconfig
import venv
from pathlib import Path

import markupsafe
import pytest
import torch
from runs import assert_same_result, decisions, finish, start, wait

import hpcft
from hpcft import events

pytestmark = pytest.mark.sandbox
NODES, PER_NODE, STEPS, FAULT_AT = 3, 2, 12, 5
SHAPE = ("--tasks-per-node", str(PER_NODE))


def _run(sandbox, out: Path, *args: str, **kw):
    return start(sandbox, out, NODES, *SHAPE, *args, per_node=PER_NODE, steps=STEPS, delay=0.2, **kw)


def _run_broadcast(sandbox, out: Path, python: Path, *args: str):
    """`_run` from the small env's interpreter, whose copy's verification imports its own package (markupsafe)."""
    return _run(sandbox, out, *args, python=str(python), HPCFT_BROADCAST_VERIFY="markupsafe")


def _records(out: Path, what: str) -> list[dict]:
    path = out / "timeline.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(json.loads, filter(None, lines)) if r["what"] == what]


def _broadcast(root: Path) -> str:
    """How the paths of a node's copy under `root` begin."""
    return f"{root}/hpcft-env-"


@pytest.fixture(scope="module")
def small_env(tmp_path_factory) -> Path:
    """The interpreter of a small venv (a few hundred KB) to broadcast: its own interpreter, and one package of its own with
    a compiled extension (markupsafe, copied in: the copy's verification must import it from the copy). torch, numpy
    and hpcft come from the shared file system through .pth entries, which the broadcasting leaves there as it leaves an
    editable install's source tree."""
    root = tmp_path_factory.mktemp("small-env") / "env"
    venv.create(root, with_pip=False, symlinks=True)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(root), "platbase": str(root)}))
    shutil.copytree(Path(markupsafe.__file__).parent, site / "markupsafe")
    shared = [Path(torch.__file__).parents[1], Path(hpcft.__file__).parents[1]]  # the test venv's packages, hpcft
    (site / "shared-tree.pth").write_text("".join(f"{p}\n" for p in shared))
    return root / "bin" / "python"


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("broadcast-cache")  # one archive of the small env for the module's runs


@pytest.fixture(scope="module")
def reference(sandbox, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("broadcast-reference")
    code, output = finish(_run(sandbox, out, "--no-standby"), timeout=300)
    assert code == 0, output[-4000:]
    assert {r["python"] for r in _records(out, "imported")} == {sys.executable}
    return out


def _no_copies_left(sandbox) -> None:
    assert not list((sandbox.dir / "disks").glob("*/hpcft-env-*")), "the janitors remove every node's copy"


@pytest.mark.timeout(900)
def test_trainers_and_a_killed_ranks_cold_relaunch_run_from_the_nodes_copies(healthy_sandbox, reference, small_env,
                                                                               cache, tmp_path):
    out = tmp_path / "broadcast"
    root = healthy_sandbox.dir / "local"  # each node's own disk
    proc = _run_broadcast(healthy_sandbox, out, small_env, "--no-standby", "--broadcast-env", "--broadcast-dir", str(root),
                       "--broadcast-cache", str(cache))
    victim: list[int] = []

    def reached() -> bool:
        victim[:] = [r["pid"] for r in _records(out, "step") if r["rank"] == 3 and r["step"] >= FAULT_AT]
        return bool(victim) or proc.poll() is not None

    wait(reached, f"rank 3 at step {FAULT_AT}", 300, story=out)
    os.kill(victim[0], signal.SIGKILL)
    code, output = finish(proc, timeout=400)
    assert code == 0, output[-4000:]
    assert [d["action"] for d in decisions(out / "job")] == ["relaunch", "done"]
    log = events.read(out / "job")
    (packed,) = [e for e in log if e["event"] == "broadcast_pack"]
    assert packed["prefix"] == str(small_env.parents[1]), packed
    assert set(packed["editable"].split(",")) == {str(Path(torch.__file__).parents[1]),
                                                  str(Path(hpcft.__file__).parents[1])}, "the .pth trees stay shared"
    broadcast = sorted(e["node"] for e in log if e["event"] == "broadcast_env")
    assert broadcast == ["n1", "n2", "n3"] and not [e for e in log if e["event"] == "broadcast_env_failed"]
    imported = _records(out, "imported")
    assert sorted(r["run"] for r in imported) == ["0.0"] * 6 + ["0.1"] * 6, "every rank, at both launches"
    for r in imported:  # the copy's interpreter; torch through its .pth, from the shared tree
        assert r["python"].startswith(_broadcast(root)) and r["torch"] == torch.__file__, r
    assert_same_result(out, reference)
    _no_copies_left(healthy_sandbox)


@pytest.mark.timeout(900)
def test_a_node_whose_broadcasting_fails_runs_from_the_shared_interpreter_and_the_standbys_use_the_copies(
        healthy_sandbox, reference, small_env, cache, tmp_path):
    out = tmp_path / "broadcast-standby"
    blocker = healthy_sandbox.dir / "disks" / "n2" / "broadcast"  # on n2 only, a file where the directory must be
    blocker.write_text("not a directory")
    root = healthy_sandbox.dir / "local" / "broadcast"
    try:
        code, output = finish(_run_broadcast(healthy_sandbox, out, small_env, "--broadcast-env", "--broadcast-dir", str(root),
                                          "--broadcast-cache", str(cache)), timeout=400)
    finally:
        blocker.unlink()
    assert code == 0, output[-4000:]
    log = events.read(out / "job")
    (failed,) = [e for e in log if e["event"] == "broadcast_env_failed"]
    assert (failed["node"], failed["level"]) == ("n2", "WARNING") and "broadcast" in failed["cause"], failed
    assert sorted(e["node"] for e in log if e["event"] == "broadcast_env") == ["n1", "n3"]
    assert {e["how"] for e in log if e["event"] == "trainer_start"} == {"warm"}, "standbys on every node"
    for r in _records(out, "imported"):
        want = str(small_env) if r["node"] == "n2" else _broadcast(root)
        assert r["python"].startswith(want), r
    assert_same_result(out, reference)
    _no_copies_left(healthy_sandbox)
