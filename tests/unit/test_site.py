"""Site settings of the batch script: module lines and Python set-up from the config file's [site] table or flags,
node-local NVMe (`hpcft submit --nvme`), and the NVMe path the rest of hpcft reads."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcft.env import nvme_dir
from hpcft.errors import ConfigError
from hpcft.launch.config import model as config
from hpcft.launch.config import site

REPO = Path(__file__).resolve().parents[2]

CONFIG = """
spares = 2
profile = "frontier"

[site]
modules = ["PrgEnv-gnu/8.7.0", "rocm/7.1.1", "rccl-net-plugin"]
setup = ["conda activate /ccs/proj/abc123/envs/torch"]
nvme = true
plugin_dirs = ["/sw/frontier/aws-ofi-nccl/lib"]
"""


def test_site_table_is_read_beside_the_run_options(tmp_path):
    path = tmp_path / "hpcft.toml"
    path.write_text(CONFIG)
    s = site.load(path)
    assert s.modules == ("PrgEnv-gnu/8.7.0", "rocm/7.1.1", "rccl-net-plugin") and s.nvme
    assert s.setup == ("conda activate /ccs/proj/abc123/envs/torch",) and s.nvme_dir == "/mnt/bb/$USER"
    assert config.load(config_file=path, environ={}).launch.spares == 2  # the run options ignore [site]
    assert site.load(None, environ={}) == site.SiteConfig()


@pytest.mark.parametrize("table, message", [
    ('[site]\nmodule = ["rocm"]', "unknown \\[site\\] key\\(s\\) module"),
    ('[site]\nmodules = "rocm"', "modules must be a list of strings"),
    ('[site]\nmodules = ["rocm; rm -rf ~"]', "is not a module name"),
    ('[site]\nnvme = "yes"', "nvme must be true or false"),
    ('[site]\nnvme_dir = "/mnt/bb/$(whoami)"', "may use letters"),
])
def test_bad_site_settings_are_named(tmp_path, table, message):
    path = tmp_path / "bad.toml"
    path.write_text(table)
    with pytest.raises(ConfigError, match=message):
        site.load(path)


def test_submit_dry_run_takes_the_site_lines_and_flags(tmp_path):
    path = tmp_path / "hpcft.toml"
    path.write_text(CONFIG)
    run = lambda *extra: subprocess.run(
        [sys.executable, str(REPO / "bin" / "hpcft"), "submit", "--config", str(path), "--nodes", "4", "--dry-run",
         *extra, "--", "python3", "train.py"], capture_output=True, text=True, timeout=60,
        env={k: v for k, v in os.environ.items() if k != "HPCFT_CONFIG"})
    out = run()
    assert out.returncode == 0, out.stderr
    assert "#SBATCH --constraint=nvme\n" in out.stdout
    assert ("module load PrgEnv-gnu/8.7.0\nmodule load rocm/7.1.1\nmodule load rccl-net-plugin\n"
            "conda activate /ccs/proj/abc123/envs/torch\nmodule load hpcft\n"
            'export HPCFT_NVME="/mnt/bb/$USER"') in out.stdout
    assert 'export HPCFT_RCCL_PLUGIN_DIRS="/sw/frontier/aws-ofi-nccl/lib"' in out.stdout
    out = run("--no-nvme", "--site-module", "rocm/6.4.2", "--setup", "source /venv/bin/activate")
    assert out.returncode == 0, out.stderr
    assert "nvme" not in out.stdout.lower() and "module load PrgEnv" not in out.stdout
    assert "module load rocm/6.4.2\nsource /venv/bin/activate\nmodule load hpcft\n" in out.stdout


def test_the_nvme_path_is_read_where_it_exists(tmp_path):
    assert nvme_dir({"HPCFT_NVME": str(tmp_path)}) == str(tmp_path)
    assert nvme_dir({"HPCFT_NVME": str(tmp_path / "absent")}) is None and nvme_dir({}) is None
