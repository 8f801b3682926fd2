"""The examples (examples/*.py) as a user runs them on a cluster: `hpcft run --spares 1 --tasks-per-node 2` in the
Slurm sandbox, 2 nodes of 2 ranks (tp.py: tensor parallel 2 inside a node, data parallel 2 across them; the others:
data parallel 4), one node crashed once the agents protected a snapshot: the spare takes its slot, every rank resumes
from memory, and the run ends bit-identical (parameters and AdamW state, final.pt) to a fault-free run of the steps.
The spare holds old copies of the surviving node's ranks, as a node does that ran that slot before a requeue moved
it: its agent protects its new slot's ranks all the same, and protection goes on after the relaunch.

Cheap by construction (CI runs the whole suite on 2 cores): the four runs go at once, two to a pair of nodes (a
sandbox node has 4 CPUs, a run takes 2 a node), and one crash hits both runs of a pair, as a node crash hits every
job on it; the fault-free reference of each is the same script run on this machine without Slurm, its ranks told
their place as torchrun tells them (helpers/example_reference.py: the same groups, mesh and batches, so the same sums
in the same order, one thread a rank here and there), forked from one interpreter while the sandbox runs wait.
"""
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from runs import decisions, finish, newest_ready, told, wait

from hpcft import events
from hpcft.agent import status as agent_status
from hpcft.deps import available
from hpcft.launch.config.sections import DEFAULT_PRELOAD
from hpcft.sandbox import procs
from hpcft.store import job_dir, secure_dir
from hpcft.store.paths import ranks

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
REFERENCE = Path(__file__).parent / "helpers" / "example_reference.py"
NODES, PER_NODE = 2, 2
RANKS = NODES * PER_NODE
STEPS = 40
BATCH = 4
ARGS = ("--steps", str(STEPS), "--width", "32", "--layers", "2", "--heads", "2", "--seq", "16", "--batch", str(BATCH),
        "--vocab", "64", "--log-every", "8")
# --sleep: the tiny model trains a step in milliseconds; a run must last until its node is crashed (_ready_to_crash)
SLEEP = "0.5"
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # one thread a rank: the same kernels here and there
# the nodes of each run (active, active, spare) and the node crashed under each pair of runs: the latest start
# (llama's standbys import transformers too) beside a slow run (fsdp2's DTensor steps), so that no run of a pair ends
# before its partner has protected a step (ddp beside llama had, on CI's box, and was crashed after its last step)
PAIRS = {"n2": (("ddp", "tp"), "n1,n2,n5"), "n4": (("fsdp2", "llama"), "n3,n4,n6")}
NAMES = ["ddp", "tp", "fsdp2"] + (["llama"] if available("transformers") else [])
# what a user of llama.py adds to the standbys' imports, so that no rank imports transformers itself
PRELOAD = {"llama": f"{DEFAULT_PRELOAD},transformers.models.llama.modeling_llama"}


@dataclass
class Run:
    """One example's run through the crash: `hpcft run`'s exit status and output, its directory, the crashed node."""
    code: int
    output: str
    out: Path
    crashed: str


def _start(sandbox, name: str, nodes: str, out: Path) -> subprocess.Popen:
    """`salloc -w NODES … hpcft run --spares 1 --tasks-per-node 2 -- python examples/NAME.py …`, at once."""
    out.mkdir(parents=True)
    argv = ["salloc", f"-N{NODES + 1}", f"--nodelist={nodes}", f"--ntasks-per-node={PER_NODE}", "--no-kill", "-t", "5",
            sys.executable, "-m", "hpcft.cli", "run", "--job-dir", str(out / "job"), "--poll-interval", "0.5",
            "--kill-grace", "1", "--probe-timeout", "5", "--spares", "1", "--tasks-per-node", str(PER_NODE),
            *(("--preload", PRELOAD[name]) if name in PRELOAD else ()), "--",
            sys.executable, str(EXAMPLES / f"{name}.py"), *ARGS, "--sleep", SLEEP, "--out", str(out)]
    return sandbox.runner().popen(argv, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _progress(out: Path) -> tuple[int, bool]:
    """(the step every node agent of the run has protected, 0 for none yet; whether the spare's standby is ready)."""
    tag = newest_ready(out / "job")
    done = [s.get("protected") for s in agent_status.read(out / "job" / "agents", tag).values()] if tag else []
    spare = any(e["event"] == "standby_ready" and e.get("spare") for e in events.read(out / "job"))
    return (min(d or 0 for d in done) if len(done) == NODES else 0), spare


def _ready_to_crash(outs: list[Path]) -> bool:
    """Every run on the node has a protected step, and the spares' standbys have imported torch, so that the relaunch
    forks the spares' ranks, as on a cluster whose spare has cores of its own (started cold here, they would import
    torch beside the standby, yielding its cores to them: the costliest seconds of the test). Under a load that holds
    a spare's standby back, the crash comes once one of the runs is half through all the same, started cold."""
    runs = [_progress(out) for out in outs]
    return all(step > 0 for step, _ in runs) and (all(spare for _, spare in runs)
                                                   or any(step >= STEPS // 2 for step, _ in runs))


def _shm(sandbox, node: str) -> Path:
    return procs.shm(sandbox.node_pids(node)[0])


def _plant_old_ranks(sandbox, nodes: str, out: Path) -> None:
    """Copy the surviving node's rank directories into the spare's store (nodes: active, crashed, spare), as a node
    holds them that ran that slot before a requeue moved it to the spares (stores outlive their run)."""
    survivor, _, spare = nodes.split(",")
    job = next(e["job"] for e in events.read(out / "job") if e.get("job"))
    src, dst = job_dir(_shm(sandbox, survivor), job), secure_dir(job_dir(_shm(sandbox, spare), job))
    for rdir in ranks(src).values():
        shutil.copytree(rdir, dst / rdir.name, ignore=shutil.ignore_patterns("*.pin", "*.lock", "*.dirty"))


@pytest.fixture(scope="module")
def crashed_runs(sandbox, tmp_path_factory) -> dict[str, Run]:
    """Every example's run through its node's crash, and (in `reference/NAME/`) its fault-free run."""
    base = tmp_path_factory.mktemp("examples")
    pairs = {node: [n for n in names if n in NAMES] for node, (names, _) in PAIRS.items()}
    procs = {name: _start(sandbox, name, PAIRS[node][1], base / name)
             for node, names in pairs.items() for name in names}
    reference = None
    try:
        left = dict(pairs)

        def crash_ready() -> bool:
            """Crash the node under a pair of runs once they are `_ready_to_crash`; True when every node is crashed."""
            ended = [name for name, proc in procs.items() if proc.poll() is not None and name in sum(left.values(), [])]
            assert not ended, f"{ended} ended before their node was crashed" + told(base / ended[0])
            for node, names in list(left.items()):
                if _ready_to_crash([base / name for name in names]):
                    for name in names:
                        _plant_old_ranks(sandbox, PAIRS[node][1], base / name)
                    sandbox.crash_node(node)  # slurmd, both runs' ranks on it, its /dev/shm
                    del left[node]
            return not left

        wait(crash_ready, "every run to be ready for its node's crash", 180, story=base / next(iter(procs)))
        # the fault-free runs take the cores while the sandbox runs detect the crash, relaunch and restore
        reference = subprocess.Popen([sys.executable, str(REFERENCE), str(base / "reference"), str(RANKS),
                                      str(PER_NODE), ",".join(NAMES), "--", *ARGS], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env={**os.environ, **ENV})
        runs = {}
        for node, names in pairs.items():
            for name in names:
                runs[name] = Run(*finish(procs[name], timeout=180), base / name, node)
        said, _ = reference.communicate(timeout=180)
        assert reference.returncode == 0, said + "".join(
            f"\n--- {log}:\n{log.read_text()[-2000:]}" for log in sorted((base / "reference").glob("*/rank-*.log")))
        yield runs
    finally:
        for proc in [*procs.values(), *([reference] if reference else [])]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        sandbox.heal()


def _differ(got: dict, want: dict) -> list[str]:
    """The parameters and AdamW states (by name) that are not bit-identical."""
    assert got["params"].keys() == want["params"].keys() and got["optim"].keys() == want["optim"].keys()
    bad = [n for n, t in want["params"].items() if not torch.equal(got["params"][n], t)]
    return bad + [f"{n}.{k}" for n, s in want["optim"].items() for k, t in s.items()
                  if not torch.equal(got["optim"][n][k], t)]


@pytest.mark.timeout(420)  # the first test waits for all four runs
@pytest.mark.parametrize("name", ["ddp", "tp", "fsdp2", pytest.param("llama", marks=pytest.mark.skipif(
    "llama" not in NAMES, reason="llama.py needs transformers: pip install 'hpcft[examples]'"))])
def test_an_example_survives_a_node_crash_bit_identical(crashed_runs, name):
    run = crashed_runs[name]
    assert run.code == 0, run.output[-4000:] + told(run.out)
    made = decisions(run.out / "job")
    assert [d["action"] for d in made] == ["replace", "done"], told(run.out)
    assert made[0]["replaced"].split(":")[0] == run.crashed, made[0]
    resumed = {e["rank"]: e["step"] for e in events.read(run.out / "job") if e["event"] == "restore_done"}
    assert sorted(resumed) == list(range(RANKS)) and len(set(resumed.values())) == 1, resumed
    assert 0 < resumed[0] < STEPS, resumed  # from memory, mid-run
    protected = [r.get("protected") for r in agent_status.read(run.out / "job" / "agents",
                                                                 newest_ready(run.out / "job")).values()]
    assert len(protected) == NODES and None not in protected and min(protected) > resumed[0], (protected, resumed)
    got = torch.load(run.out / "final.pt", weights_only=True)
    want = torch.load(run.out.parent / "reference" / name / "final.pt", weights_only=True)
    replicas = RANKS // PER_NODE if name == "tp" else RANKS
    assert (got["step"], got["seen"]) == (want["step"], want["seen"]) == (STEPS, {"samples": STEPS * BATCH * replicas})
    assert not _differ(got, want), f"{_differ(got, want)} differ from the fault-free run"
