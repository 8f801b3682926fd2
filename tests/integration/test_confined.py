"""A warm-started rank on a confined node (`hpcft sandbox up --confine`: task/cgroup, task/affinity, 8 fake GPUs per
node): forked by the node's standby, which lives in a step of its own, it runs in its own trainer step's cgroups
with exactly that step's cores and GPU — before and after a node crash moves a slot to the spare. What srun placed
in the step (the task wrapper, as a cold rank would be) is the yardstick."""
import json
import subprocess
from pathlib import Path

from runs import finished_ok, start, wait

from hpcft import events

HELPER = Path(__file__).parent / "helpers" / "confined_rank.py"
NODES, TASKS = 2, 2  # active nodes, ranks (GPUs) per node; one spare
CONFINED = ("cpuset", "memory", "devices", "freezer")


def _reports(out: Path) -> dict[int, dict]:
    return {int(p.name.split(".")[1]): json.loads(p.read_text()) for p in out.glob("rank.*.json")}


def _cgroups(text: str) -> dict[str, str]:
    return {line.split(":")[1]: line.split(":", 2)[2] for line in text.splitlines() if line.split(":")[1] in CONFINED}


def _jobs(directories: list[Path]) -> list[Path]:
    return [p for d in directories for p in d.rglob("job_*")]


def _assert_confined(reports: dict[int, dict]) -> None:
    """Each rank: in its own task's cgroups and affinity (its wrapper's), its own GPU opens (ENXIO: no driver), every
    other GPU is refused by the devices cgroup (EPERM), and its neighbour on the node has another GPU and core."""
    assert sorted(reports) == list(range(NODES * TASKS)), reports
    for rank, got in reports.items():
        wrapper = got["wrapper"]
        assert wrapper and wrapper["pid"] != got["pid"], (rank, got)
        assert _cgroups(got["cgroup"]) == _cgroups(wrapper["cgroup"]), (rank, got)
        assert "/step_" in _cgroups(got["cgroup"])["devices"], got  # a step's, not the node's
        assert got["affinity"] == wrapper["affinity"] and len(got["affinity"]) == 1, (rank, got)
        own = [gpu for gpu, how in got["opens"].items() if how == "ENXIO"]
        assert len(own) == 1 and len(got["opens"]) == 8, (rank, got["opens"])
        assert {how for gpu, how in got["opens"].items() if gpu not in own} == {"EPERM"}, (rank, got["opens"])
    for node in {r["node"] for r in reports.values()}:
        mine = [r for r in reports.values() if r["node"] == node]
        gpus = {next(g for g, how in r["opens"].items() if how == "ENXIO") for r in mine}
        assert len(mine) == TASKS and len(gpus) == TASKS and len({tuple(r["affinity"]) for r in mine}) == TASKS, mine


def test_a_warm_rank_runs_in_its_own_steps_cgroups_with_its_cores_and_gpu(healthy_confined_sandbox, tmp_path):
    sb = healthy_confined_sandbox
    out = tmp_path / "run"
    proc = start(sb, out, NODES + 1, "--spares", "1", "--tasks-per-node", str(TASKS),
                 "--srun-args=--gpus-per-task=1", per_node=TASKS, job=HELPER, salloc=(f"--gres=gpu:{TASKS}",),
                 GPU_DIR=str(sb.layout.gpu_dir), WAIT_GO="1")
    wait(lambda: len(_reports(out)) == NODES * TASKS, "the first launch's ranks", 120, story=out)
    first = _reports(out)
    _assert_confined(first)
    for path in out.glob("rank.*.json"):
        path.unlink()
    crashed = first[TASKS]["node"]  # the second slot's node: the spare takes it, once its standby is ready
    wait(lambda: sum(e["event"] == "standby_ready" for e in events.read(out / "job")) == NODES + 1,
         "the spare's standby", 120, story=out)
    sb.crash_node(crashed)
    wait(lambda: len(_reports(out)) == NODES * TASKS, "the relaunch's ranks", 120, story=out)
    again = _reports(out)
    (out / "go").touch()
    log, made, _ = finished_ok(proc, out)
    _assert_confined(again)
    assert crashed not in {r["node"] for r in again.values()}
    assert [d["action"] for d in made] == ["replace", "done"]
    started = [e for e in log if e["event"] == "trainer_start"]
    assert [e["how"] for e in started] == ["warm"] * (2 * NODES * TASKS), started
    assert {e["pid"] for e in started} == {r["pid"] for r in (*first.values(), *again.values())}
    assert not [e for e in events.read(out / "job") if e["event"] == "standby_refused"]


def test_a_confined_sandbox_gives_each_node_its_own_cgroups_and_removes_them_on_down(confined_sandbox):
    """A sandbox of its own beside the session's (one node, where the tests' reaper finds it if the session is
    killed): its slurmd sees its node's cgroup as the root, a restarted node starts from an empty one, and `down`
    leaves no cgroup behind."""
    import shutil

    from hpcft.sandbox import Sandbox, SandboxConfig
    from hpcft.sandbox.config import plan

    directory = confined_sandbox.dir.with_name(confined_sandbox.dir.name + "-own")
    sb = Sandbox(plan(SandboxConfig(dir=directory, nodes=1, confine=True, prolog=None, epilog=None)))
    sb.up(timeout=60)
    try:
        made = [Path(d) for d in sb.created_cgroups]  # one per controller
        assert len(made) == len(CONFINED) and all(d.is_dir() for d in made), made
        assert all(d.name == "n1" and d.parent.name == f"hpcft-sandbox-{sb.config.tag}" for d in made), made
        slurmd = str(sb.groups["n1"].pid)
        host_view = _cgroups(Path(f"/proc/{slurmd}/cgroup").read_text())
        assert all(path.endswith(f"/hpcft-sandbox-{sb.config.tag}/n1") for path in host_view.values()), host_view
        inside = subprocess.run(["nsenter", "-t", slurmd, "--cgroup", "cat", f"/proc/{slurmd}/cgroup"],
                                capture_output=True, text=True, check=True).stdout
        assert set(_cgroups(inside).values()) == {"/"}, "in its cgroup namespace, its node's cgroup is the root"
        step = sb.runner().popen(["srun", "-N1", "sleep", "60"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait(lambda: _jobs(made), "the step's cgroups below the node's", 30)
            sb.restart_node("n1", timeout=60)  # crashed with the step in it: what Slurm made stays, until removed
            assert not _jobs(made), "a restarted node starts from an empty cgroup"
        finally:
            step.kill()
            step.wait()
    finally:
        sb.down()
        shutil.rmtree(directory, ignore_errors=True)
    assert not [d for d in made if d.parent.exists()], made
