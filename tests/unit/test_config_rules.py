"""Every configuration the options model rejects is refused by `hpcft run` before its first srun, one case per rule:
the values alone (at load, before the supervisor exists) and the values against the allocation's shape and paths (the
supervisor's start state, with Slurm's answers canned and every step recorded: none may start)."""
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from hpcft.errors import ConfigError
from hpcft.launch.cli import run
from hpcft.launch.config import command
from hpcft.launch.config import model as config
from hpcft.launch.config import resolve
from hpcft.launch.supervisor import Supervisor

VALUES = [  # (options, words of the error)
    ({"nodes": 0}, "nodes must be at least 1"),
    ({"spares": -1}, "spares must be 0 or more"),
    ({"tasks_per_node": 0}, "tasks_per_node must be at least 1"),
    ({"max_restarts": -1}, "max_restarts must be 0 or more"),
    ({"hang_timeout": -1}, "hang_timeout must be 0 or more"),
    ({"start_timeout": -5}, "start_timeout must be 0 or more"),
    ({"kill_grace": -1}, "kill_grace must be 0 or more"),
    ({"requeue_margin": -1}, "requeue_margin must be 0 or more"),
    ({"loss_timeout": -1}, "loss_timeout must be 0 or more"),
    ({"protect_timeout": -1}, "protect_timeout must be 0 or more"),
    ({"poll_interval": 0}, "poll_interval must be positive"),
    ({"probe_timeout": 0}, "probe_timeout must be positive"),
    ({"profile": "summit"}, "profile='summit' is not one of cpu, cuda, frontier"),
    ({"protect": "raid"}, "protect='raid' is not one of auto, none, partner, xor, rs"),
    ({"protect": "xor", "losses": 2}, "xor tolerates exactly one loss"),
    ({"protect": "rs", "group": 2, "losses": 2}, "rs needs 1 <= losses < group"),
    ({"group": 0}, "group must be at least 1"),
    ({"distance": 0}, "distance must be positive"),
    ({"protect_rate": 0}, "protect_rate must be positive"),
    ({"protect_lag": -1}, "protect_lag must be 0 or more"),
    ({"agent_cores": -0.5}, "agent_cores must be 0 or more"),
    ({"agent_transport": "ucx"}, "agent_transport='ucx' is not one of tcp, mpi"),
    ({"agent_mpi": "pm ix"}, "is not an srun MPI plugin name"),
    ({"keep": 0}, "keep must be at least 1"),
    ({"state_bytes": "0"}, "state_bytes must be positive"),
    ({"node_memory": "12 apples"}, "node_memory='12 apples' is not a valid"),
    ({"memory_headroom": 1.0}, "memory_headroom must be a fraction in [0, 1)"),
    ({"persist_every": 0}, "persist_every must be at least 1"),
    ({"persist_keep": 0}, "persist_keep must be at least 1"),
    ({"persist_rate": -1}, "persist_rate must be positive"),
    ({"elastic_batch": "keep-both"}, "elastic_batch='keep-both' is not one of keep-global, keep-per-rank"),
    ({"min_nodes": 2}, "min_nodes is given without elastic"),
    ({"elastic_grow": True}, "elastic_grow is given without elastic"),
    ({"elastic": True, "protect": "none"}, "elastic needs protection across nodes"),
    ({"elastic": True, "persist_dir": "none"}, "elastic needs a durable tier"),
    ({"elastic": True, "nodes": 2, "min_nodes": 3}, "min_nodes 3 is more than nodes 2"),
    ({"grow_settle": -1}, "grow_settle must be 0 or more"),
    ({"straggler_factor": 1.0}, "straggler_factor must be above 1"),
    ({"straggler_window": 0}, "straggler_window must be positive"),
    ({"evict_stragglers": True, "protect": "none"}, "evict_stragglers needs protection across nodes"),
    ({"evict_stragglers": True, "straggler_factor": 0}, "evict_stragglers is given with straggler_factor 0"),
    ({"preload": "torch,my-module"}, "'my-module' is not a module name"),
    ({"copy": "warp,threads=2"}, "warp"),
    ({"lost_progress_exit": 3}, "lost_progress_exit must be 0 (off) or an exit status from 6 to 125"),
    ({"bogus": 1}, "unknown option 'bogus'"),
]


@pytest.mark.parametrize("options,words", VALUES, ids=[",".join(o) for o, _ in VALUES])
def test_hpcft_run_refuses_a_value_no_run_can_use_before_anything_starts(options, words, tmp_path):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        config.load(options, environ={})
    argv = []
    for key, value in options.items():
        flag = command.flag(key)
        argv += [flag if value is True else f"{flag}={value}"] if key in config.OPTIONS else [f"--{key}", str(value)]
    out = CliRunner().invoke(run, [*argv, "--", "true"], env={"SLURM_JOB_ID": ""})
    assert out.exit_code != 0 and "Traceback" not in out.output, out.output


class _Slurm:
    """scontrol's answer for a job of `nodes` nodes; every srun recorded (none may start)."""

    timeout = 10

    def __init__(self, nodes: int):
        self.nodes, self.started = nodes, []

    def run(self, argv, check=True, **kw):
        out = ""
        if argv[:3] == ["scontrol", "show", "job"]:
            out = (f"JobId=7 JobState=RUNNING NumNodes={self.nodes} BatchFlag=1 Requeue=1 Restarts=0 "
                   f"NodeList=frontier[{1:05d}-{self.nodes:05d}]")
        return subprocess.CompletedProcess(argv, 0, out, "")

    def popen(self, argv, **kw):
        self.started.append(argv)
        return subprocess.Popen([sys.executable, "-c", "pass"], **kw)


SHAPES = [  # (allocated nodes, options, words of the error)
    # spares are what the allocation has beyond the active nodes (hpcft submit asks for a range): active ones missing
    (3, {"nodes": 4, "spares": 1}, "--nodes 4 and --spares 0 need 4 nodes; the allocation has 3"),
    (3, {"spares": 3}, "--nodes 0 and --spares 3 need 3 nodes"),
    (3, {"protect": "xor", "group": 4}, "xor with group 4 needs at least 4 nodes"),
    (4, {"protect": "rs", "group": 4, "losses": 2, "spares": 1}, "rs with group 4 needs at least 4 nodes"),
    (3, {"protect": "partner", "distance": 3}, "partner"),
    (4, {"elastic": True, "min_nodes": 4, "spares": 1}, "--min-nodes 4 is more than the 3 active nodes"),
    (4, {"persist_dir": "/proc/hpcft-durable"}, "persist_dir /proc/hpcft-durable cannot be made"),
    (4, {"broadcast_cache": "/proc/hpcft-broadcast"}, "broadcast_cache /proc/hpcft-broadcast cannot be made"),
    (4, {"job_dir": "/proc/hpcft-job"}, "job_dir /proc/hpcft-job cannot be made"),
]


@pytest.mark.parametrize("allocated,options,words", SHAPES, ids=[",".join(o) for _, o, _ in SHAPES])
def test_hpcft_run_refuses_what_the_allocation_cannot_carry_before_its_first_srun(allocated, options, words, tmp_path):
    slurm = _Slurm(allocated)
    cfg = config.make(**{"job_dir": str(tmp_path / "job"), **options})
    with pytest.raises(ConfigError, match=words):
        Supervisor(cfg, ["python", "train.py"], runner=slurm, environ={"SLURM_JOB_ID": "7", "USER": "me"}).run()
    assert slurm.started == []  # no srun: no step, no janitor wiping a requeued run's memory


def test_an_explicit_scheme_without_a_group_takes_the_largest_set_the_nodes_allow():
    assert resolve.check_shape(config.make(protect="xor"), 3).protection.group == 3
    assert resolve.check_shape(config.make(protect="xor", spares=1), 9).protection.group == 4
    assert resolve.check_shape(config.make(protect="rs", losses=2), 3).protection.group == 3
    assert resolve.check_shape(config.make(), 2).protection.protect == "partner"


def test_run_help_fits_a_screen_and_help_all_reaches_every_option():
    runner = CliRunner()
    short, every = runner.invoke(run, ["--help"]).output, runner.invoke(run, ["--help-all"]).output
    assert len(short.splitlines()) <= 60, short
    missing = [command.flag(k) for k in config.OPTIONS if command.flag(k) not in every]
    assert not missing, missing


def test_the_configuration_reference_is_generated_from_the_model():
    path = os.path.join(os.path.dirname(__file__), "..", "..", command.REFERENCE)
    with open(path, encoding="utf-8") as f:
        assert f.read() == command.reference(), (f"{command.REFERENCE} is out of date: run `python -m "
                                                 f"hpcft.launch.config.command > {command.REFERENCE}`")


def test_a_requeued_run_whose_excluded_nodes_are_not_allocated_passes_the_shape_check(tmp_path):
    """The previous run's excluded nodes are outside this allocation (Slurm kept them out): none of its nodes."""
    from hpcft.launch.policy.state import RunState

    class Started(Exception):
        pass

    def first_srun(argv, **kw):
        raise Started(argv)

    job = tmp_path / "job"
    job.mkdir()
    RunState(requeues=1, excluded=["frontier00098", "frontier00099"]).save(job / "state.json")
    slurm = _Slurm(4)
    slurm.popen = first_srun
    cfg = config.make(job_dir=str(job), nodes=3, spares=1, protect="none", persist_dir="none", standby=False)
    with pytest.raises(Started):
        Supervisor(cfg, ["python", "train.py"], runner=slurm, environ={"SLURM_JOB_ID": "7", "USER": "me"}).run()
