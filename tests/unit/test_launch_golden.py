"""Golden files for the command lines and scripts hpcft generates (srun argv, sbatch scripts).

When a change to them is intended, refresh the records and review the diff:
    HPCFT_UPDATE_GOLDEN=1 .venv/bin/python -m pytest -q tests/unit/test_launch_golden.py && git diff tests/unit/golden
The sbatch scripts are also checked by `bash -n`.
"""
import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from hpcft.agent.settings import AgentConfig
from hpcft.agent.step import agent_argv
from hpcft.errors import ConfigError
from hpcft.launch.config import netplugin
from hpcft.launch.config import model as config
from hpcft.launch.config import profiles
from hpcft.launch.config.site import SiteConfig
from hpcft.launch.submit import SubmitSpec, render, walltime_seconds
from hpcft.launch.policy.layout import Layout
from hpcft.launch.node.srun import probe_argv, trainer_argv
from hpcft.launch.steps.agentconf import agent_mpi, agent_settings

GOLDEN = Path(__file__).parent / "golden"
NODES = [f"frontier{n:05d}" for n in range(10, 16)]


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("HPCFT_UPDATE_GOLDEN"):
        path.write_text(text, encoding="utf-8")
    if not path.exists():
        pytest.fail(f"no golden file {path}; create it with HPCFT_UPDATE_GOLDEN=1 (see this module's docstring)")
    assert text == path.read_text(encoding="utf-8"), (
        f"{name} differs from its golden file; if the change is intended, rerun with HPCFT_UPDATE_GOLDEN=1")


def _lines(argv: list[str]) -> str:
    return " \\\n  ".join(shlex.quote(a) for a in argv) + "\n"


@pytest.mark.parametrize("profile", ["frontier", "cuda", "cpu"])
def test_trainer_srun_line(profile):
    prof = profiles.get(profile)
    lay, _ = Layout.plan(NODES, spares=2, tasks_per_node=prof.tasks_per_node).replace([NODES[1]])
    argv = trainer_argv(lay, prof, ["python3", "train.py", "--config", "cfg.yaml"], python="python3",
                        extra="--cpu-bind=cores")
    check_golden(f"srun-{profile}.txt", _lines(argv))


def test_probe_srun_line():
    check_golden("srun-probe.txt", _lines(probe_argv(NODES[:4])))


@pytest.mark.parametrize("profile", ["frontier", "cpu"])
def test_sbatch_script(profile):
    spec = SubmitSpec(command=("python3", "train.py", "--config", "my cfg.yaml"), nodes=64, spares=2, time="06:00:00",
                      profile=profile, account="ABC123", partition="batch", job_name="llm-7b", warn_seconds=600,
                      run_options={"max_restarts": 5, "hang_timeout": 900.0, "requeue": True, "nodes": 64})
    script = render(spec)
    check_golden(f"sbatch-{profile}.sh", script)
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


# a Frontier site as OLCF's PyTorch guide sets one up (module versions of its batch example, a conda environment)
FRONTIER_SITE = SiteConfig(
    modules=("PrgEnv-gnu/8.7.0", "cpe/26.03", "miniforge3/23.11.0-0", "rocm/7.1.1", "rccl-net-plugin",
             "craype-accel-amd-gfx90a"),
    setup=("export LD_LIBRARY_PATH=$CRAY_LD_LIBRARY_PATH:$LD_LIBRARY_PATH", "conda activate /ccs/proj/abc123/envs/torch"),
    nvme=True, plugin_dirs=("/sw/frontier/aws-ofi-nccl/lib",))


def test_sbatch_script_with_site_modules_and_nvme():
    spec = SubmitSpec(command=("python3", "train.py"), nodes=64, spares=2, time="06:00:00", profile="frontier",
                      account="ABC123", job_name="llm-7b", site=FRONTIER_SITE,
                      run_options={"state_bytes": 96 << 30, "agent_iface": "hsn0", "nodes": 64})
    script = render(spec)
    check_golden("sbatch-frontier-site.sh", script)
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert "#SBATCH --constraint=nvme" not in render(SubmitSpec(command=("x",), nodes=1, site=FRONTIER_SITE, nvme=False))


def test_frontier_environment():
    """What the trainer and agent steps get from the Frontier profile on a node where the RCCL plugin is installed
    in the site's directory but not on the library path (a fake tree: names only)."""
    plugin_dir = "/sw/frontier/aws-ofi-nccl/lib"
    environ = {netplugin.DIRS_ENV: plugin_dir, "LD_LIBRARY_PATH": "/opt/rocm-7.1.1/lib", "USER": "alice",
               "NCCL_SOCKET_IFNAME": "hsn0"}  # the user's own value wins over the profile's four NICs
    state = netplugin.resolve(environ, isfile=lambda p: False,
                              listdir=lambda d: ["librccl-net.so", "libnccl-net.so"] if d == plugin_dir else [])
    env = profiles.env_defaults(profiles.FRONTIER, environ, user="alice", job="1234",
                                plugin=netplugin.plugin_env(state, environ))
    check_golden("env-frontier.txt", "".join(f"{k}={v}\n" for k, v in sorted(env.items())))
    assert "NCCL_SOCKET_IFNAME" not in env and "FI_CXI_RDZV_PROTO" not in env
    alt = profiles.env_defaults(profiles.FRONTIER, {"SLURM_NETWORK": "disable_rdzv_get"}, user="a", job="1")
    assert alt["FI_CXI_RDZV_PROTO"] == "alt_read"  # only with the allocation flag OLCF pairs it with


def test_agent_srun_line_and_settings():
    """The agents' step carries the settings of a Frontier run's configuration, asks for the node's 56 user cores
    (shared with the trainers, bound to none); the settings have a record of their own too."""
    cfg = config.make(profile="frontier", protect="xor", group=4, protect_lag=3)
    settings = agent_settings(cfg, Path("/lustre/job"), Layout(slots=tuple(NODES[:4])), mpi=None)
    check_golden("srun-agents-frontier.txt", _lines(agent_argv(NODES[:4], settings, python="python3", cpus=56)))
    check_golden("agent-settings-frontier.json", json.dumps(json.loads(settings.to_json()), indent=1) + "\n")
    assert AgentConfig.from_json(settings.to_json()) == settings


def test_submit_refuses_a_bad_job_name_and_an_empty_command():
    with pytest.raises(ConfigError, match="job name 'a b' may use letters"):
        render(SubmitSpec(command=("x",), nodes=1, job_name="a b"))
    with pytest.raises(ConfigError, match="no training command given"):
        render(SubmitSpec(command=(), nodes=1))


@pytest.mark.parametrize("text, seconds", [("5", 300), ("5:30", 330), ("1:00:00", 3600), ("2-3", 183600),
                                           ("1-0:30", 88200), ("0-1:2:3", 3723), ("UNLIMITED", None)])
def test_walltime_is_read_in_every_slurm_form(text, seconds):
    assert walltime_seconds(text) == seconds


def test_submit_refuses_a_warning_not_shorter_than_the_walltime():
    with pytest.raises(ConfigError, match="--warn 300 s is not shorter than the walltime --time 5 \\(300 s\\)"):
        render(SubmitSpec(command=("x",), nodes=1, time="5"))
    with pytest.raises(ConfigError, match="--time '5 min' is not a Slurm time"):
        render(SubmitSpec(command=("x",), nodes=1, time="5 min"))
    assert "--signal=B:USR1@60" in render(SubmitSpec(command=("x",), nodes=1, time="5", warn_seconds=60))


def test_agent_srun_line_over_mpi_on_frontier():
    """--agent-transport mpi: the agents' step is started by Cray MPICH's PMI plugin and told to mesh over MPI."""
    cfg = config.make(profile="frontier", protect="xor", group=4, agent_transport="mpi")
    settings = agent_settings(cfg, Path("/lustre/job"), Layout(slots=tuple(NODES[:4])), mpi=agent_mpi(cfg))
    assert settings.transport == "mpi"
    check_golden("srun-agents-frontier-mpi.txt",
                 _lines(agent_argv(NODES[:4], settings, python="python3", mpi=profiles.FRONTIER.agent_mpi)))
