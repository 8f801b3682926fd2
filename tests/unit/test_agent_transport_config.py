"""The agents' transport as configuration: CLI > HPCFT_AGENT_TRANSPORT > file, the srun MPI plugin from the profile
unless given, bad values refused by name, and a ConfigError naming what to install when MPI is chosen without a
usable mpi4py (a real failed import, in a fresh interpreter)."""
import subprocess
import sys

import pytest

from hpcft.errors import ConfigError
from hpcft.launch.config import model as config
from hpcft.launch.steps.agentconf import agent_mpi


def test_tcp_is_the_default_and_the_environment_and_cli_override_the_file(tmp_path):
    assert config.load({}, environ={}).protection.agent_transport == "tcp"
    cfg_file = tmp_path / "run.toml"
    cfg_file.write_text('agent_transport = "tcp"\nagent_mpi = "pmi2"\n')
    from_env = config.load({}, environ={"HPCFT_AGENT_TRANSPORT": "mpi"}, config_file=cfg_file)
    assert (from_env.protection.agent_transport, from_env.protection.agent_mpi) == ("mpi", "pmi2")
    cli = config.load({"agent_transport": "tcp"}, environ={"HPCFT_AGENT_TRANSPORT": "mpi"}, config_file=cfg_file)
    assert cli.protection.agent_transport == "tcp"


def test_the_srun_plugin_is_the_profile_s_unless_given_and_only_with_mpi():
    assert agent_mpi(config.load({"profile": "frontier", "agent_transport": "mpi"}, environ={})) == "cray_shasta"
    assert agent_mpi(config.load({"profile": "cpu", "agent_transport": "mpi"}, environ={})) == "pmix"
    assert agent_mpi(config.load({"agent_transport": "mpi", "agent_mpi": "pmi2"}, environ={})) == "pmi2"
    assert agent_mpi(config.load({"profile": "frontier"}, environ={})) is None


@pytest.mark.parametrize("given,named", [({"agent_transport": "ucx"}, "agent_transport='ucx'"),
                                         ({"agent_mpi": "pmix --pty"}, "srun MPI plugin")])
def test_bad_values_are_refused_by_name(given, named):
    with pytest.raises(ConfigError, match=named):
        config.load(given, environ={})


def test_mpi_without_mpi4py_is_a_config_error_naming_what_to_install():
    code = ("import sys; sys.modules['mpi4py'] = None\n"
            "from hpcft.agent.transport import mpiworld\n"
            "try:\n    mpiworld.library()\nexcept Exception as exc:\n    print(type(exc).__name__, exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert out.startswith("ConfigError --agent-transport mpi:") and "pip install 'hpcft[mpi]'" in out, out


def test_mpi_with_mpi4py_names_its_library():
    pytest.importorskip("mpi4py")
    from hpcft.agent.transport import mpiworld

    assert "MPI" in mpiworld.library()
