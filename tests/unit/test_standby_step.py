"""The standby step as the supervisor runs it (hpcft/launch/steps/standbys.py): its srun line, its options, and the
waits of a launch for the nodes' standbys (a sleeping process for the step, status files written by the test)."""
import subprocess
import sys
import threading
import time

import pytest

from hpcft.launch.node import standby
from hpcft.launch.steps.standbys import cpus_per_node, standby_argv


def test_the_standby_step_covers_the_nodes_with_their_cpus():
    assert cpus_per_node({"SLURM_JOB_CPUS_PER_NODE": "56(x4),28"}) == 28
    assert cpus_per_node({}) is None and cpus_per_node({"SLURM_JOB_CPUS_PER_NODE": "?"}) is None
    argv = standby_argv(["n1", "n2", "n5"], python="/py", job_dir="/j", preload="torch", cpus=8)
    assert argv[:10] == ["srun", "--job-name=hpcft-standby", "--nodes=3", "--ntasks=3", "--ntasks-per-node=1",
                         "--nodelist=n[1-2,5]", "--overlap", "--kill-on-bad-exit=0", "--no-kill", "--export=ALL"]
    assert argv[10:] == ["--cpus-per-task=8", "--cpu-bind=none", "/py", "-m", "hpcft.launch.node.standby", "--job-dir",
                         "/j", "--preload", "torch"]
    spared = standby_argv(["n1", "n5"], python="/py", job_dir="/j", preload="torch", spares=["n5"], since=12.5)
    assert spared[-4:] == ["--spares", "n5", "--since", "12.500"]  # a spare's preload waits behind the others

def test_the_standby_options_from_every_place_and_forwarded_by_submit(tmp_path):
    from hpcft.launch.config import model as config

    assert config.load({}, environ={}).standby.standby is True  # the default
    assert config.load({}, environ={"HPCFT_STANDBY": "0"}).standby.standby is False
    cfg = config.load({"standby": True, "preload": "torch, transformers.models"}, environ={"HPCFT_STANDBY": "0"})
    assert cfg.standby.standby is True and cfg.standby.preload == "torch, transformers.models"
    with pytest.raises(config.ConfigError, match="'torch nn' is not a module name"):
        config.load({"preload": "torch nn"}, environ={})
    script = subprocess.run([sys.executable, "-m", "hpcft.cli", "submit", "--nodes", "2", "-t", "10", "--dry-run",
                             "--no-standby", "--preload", "torch,numpy", "--", "python", "t.py"],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert script.returncode == 0, script.stderr
    assert "--no-standby --preload torch,numpy" in script.stdout

def test_a_spare_given_a_slot_is_waited_for_at_that_launch_and_a_node_only_once(tmp_path):
    """The first launch waits for the active nodes' standbys; a spare's imports behind them, so a relaunch onto it
    soon after came before it was ready and that rank started cold (found once the loss was decided sooner): the
    relaunch waits for the spare's standby (a cold rank would import as long). A node waited for once, or one the
    step does not cover (a node back later), is not waited for again."""
    said: list = []
    standbys = _standbys(tmp_path, said)
    try:
        for node in ("n1", "n2"):
            standby.write_status(tmp_path, node, phase="ready", import_s=1.0)
        assert set(standbys.wait(["n1", "n2"], timeout=5)) == {"n1", "n2"}
        assert standby.active_ready_path(tmp_path).exists()  # the spare may import at full priority now
        threading.Timer(0.5, lambda: standby.write_status(tmp_path, "n3", phase="ready", import_s=2.0)).start()
        started = time.monotonic()
        assert set(standbys.wait(["n1", "n3"], timeout=5)) == {"n3"}  # the spare took a slot: waited for
        assert 0.4 < time.monotonic() - started < 4
        assert standbys.wait(["n1", "n3"], timeout=5) == {} and standbys.wait(["n9"], timeout=5) == {}
        assert [f["nodes"] for k, f in said if k == "standby_wait"] == [2, 1]
    finally:
        standbys.proc.kill()
        standbys.proc.wait()


def test_a_spares_standby_that_never_says_ready_is_waited_for_twice_the_active_ones_import_not_120_s(
        tmp_path, monkeypatch):
    """A standby that cannot write its status (a full job directory) said nothing: the relaunch onto its spare waits
    as long as a cold start would take (SPARE_WAIT_FACTOR × the active standbys' import, at least the floor), then its
    rank starts cold; it once waited READY_TIMEOUT_S (120 s) there."""
    from hpcft.launch.steps import standbys as module

    monkeypatch.setattr(module, "SPARE_WAIT_FLOOR_S", 0.5)
    said: list = []
    standbys = _standbys(tmp_path, said)
    try:
        for node in ("n1", "n2"):
            standby.write_status(tmp_path, node, phase="ready", import_s=0.1)
        assert set(standbys.wait(["n1", "n2"])) == {"n1", "n2"}
        started = time.monotonic()
        assert standbys.wait(["n3"]) == {}
        assert 0.4 < time.monotonic() - started < 5
        assert "n3: no standby ready" in said[-1][1]["reason"] and said[-1][1]["action"].endswith("start cold")
    finally:
        standbys.proc.kill()
        standbys.proc.wait()


def _standbys(job_dir, said: list):
    """A Standbys whose step (a sleeping process, no Slurm) covers n1, n2 and the spare n3; its events into `said`."""
    from hpcft.launch.steps.standbys import Standbys
    from hpcft.slurm.runner import Runner

    class Sleeper(Runner):
        def popen(self, argv, **kw):
            return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], **kw)

    standbys = Standbys(Sleeper(), job_dir, sys.executable, "json", {}, emit=lambda kind, **f: said.append((kind, f)),
                        stop_steps=lambda procs: [p.kill() or p.wait() for p in procs.values()])
    standbys.ensure(["n1", "n2", "n3"], {}, spares=["n3"])
    return standbys
