"""The one Slurm command seam: argv building, environment, and errors that name the command."""
import sys

import pytest

from hpcft.errors import SlurmError
from hpcft.slurm.runner import Runner


def test_prefix_and_env():
    runner = Runner(prefix=["env"], env={"SLURM_CONF": "/x/slurm.conf"})
    assert runner.argv(["srun", "-N", 4]) == ["env", "srun", "-N", "4"]
    out = runner.run([sys.executable, "-c", "import os; print(os.environ['SLURM_CONF'])"]).stdout
    assert out.strip() == "/x/slurm.conf"


def test_failure_names_command_and_stderr():
    with pytest.raises(SlurmError, match=r"exit status 3: boom"):
        Runner().run([sys.executable, "-c", "import sys; sys.stderr.write('boom'); sys.exit(3)"])
    assert Runner().run([sys.executable, "-c", "raise SystemExit(3)"], check=False).returncode == 3


def test_missing_binary_says_which_package():
    with pytest.raises(SlurmError, match="slurm-client"):
        Runner(env={"PATH": "/nonexistent"}).run(["sbatch", "--version"])


def test_timeout():
    with pytest.raises(SlurmError, match="did not finish"):
        Runner().run([sys.executable, "-c", "import time; time.sleep(5)"], timeout=0.5)
