"""The profile from the machine: the site's name in the environment, else the node's GPUs; a profile that does not
fit the node is refused before anything is launched, unless the check is turned off (environments as dicts)."""
from __future__ import annotations

import pytest

from hpcft.errors import ConfigError
from hpcft.launch.config import model as config
from hpcft.launch.config.detect import Devices, check_fits, detect, devices
from hpcft.launch.config.resolve import check_node

FRONTIER_NODE = Devices(amd=8)


@pytest.mark.parametrize("environ,found,profile", [
    ({"SLURM_CLUSTER_NAME": "frontier"}, FRONTIER_NODE, "frontier"),
    ({"LMOD_SYSTEM_NAME": "frontier"}, None, "frontier"),  # `hpcft submit` on a login node
    ({"SLURM_CLUSTER_NAME": "Frontier "}, Devices(), "frontier"),  # the name decides, whatever this node shows
    ({"SLURM_CLUSTER_NAME": "perlmutter"}, Devices(nvidia=4), "cuda"),
    ({}, Devices(amd=2), "cuda"),  # a GPU node of an unknown site: one task per GPU
    ({}, Devices(), "cpu"),
    ({}, None, "cpu"),
])
def test_detect(environ, found, profile):
    assert detect(environ, found)[0] == profile


def test_hpcft_run_takes_the_detected_profile_unless_one_is_given(tmp_path):
    frontier = {"SLURM_CLUSTER_NAME": "frontier"}
    assert config.load({}, environ=frontier, node=FRONTIER_NODE).launch.profile == "frontier"
    assert config.load({"profile": "cpu"}, environ=frontier, node=FRONTIER_NODE).launch.profile == "cpu"
    assert config.load({}, environ={**frontier, "HPCFT_PROFILE": "cuda"}).launch.profile == "cuda"
    toml = tmp_path / "run.toml"
    toml.write_text('profile = "cuda"\n')
    assert config.load({}, environ=frontier, config_file=toml).launch.profile == "cuda"


def test_a_profile_that_does_not_fit_the_node_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"profile frontier trains on GPUs.*--profile cpu.*HPCFT_PROFILE_CHECK=0"):
        check_fits("frontier", Devices())
    with pytest.raises(ConfigError, match=r"profile cpu trains on the CPU, but this node has 8 AMD \(ROCm\) GPU"):
        check_fits("cpu", FRONTIER_NODE)
    check_fits("frontier", FRONTIER_NODE)
    check_fits("cpu", Devices())


def test_the_check_can_be_turned_off_where_a_profile_is_forced():
    forced = config.load({"profile": "frontier"}, environ={"HPCFT_PROFILE_CHECK": "0"})
    check_node(forced, Devices())
    with pytest.raises(ConfigError):
        check_node(config.make(profile="frontier"), Devices())


def test_devices_reads_a_nodes_dev_directory(tmp_path):
    (tmp_path / "dri").mkdir()
    for name in ("dri/renderD128", "dri/renderD129", "nvidia0", "nvidiactl", "nvidia-uvm"):
        (tmp_path / name).touch()
    assert devices(tmp_path) == Devices(amd=0, nvidia=1)  # render nodes without /dev/kfd are not ROCm's
    (tmp_path / "kfd").touch()
    assert devices(tmp_path) == Devices(amd=2, nvidia=1)
