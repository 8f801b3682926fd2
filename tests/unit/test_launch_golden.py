"""Golden files for the command lines and scripts hpcft generates (srun argv, sbatch scripts).

When a change to them is intended, refresh the records and review the diff:
    HPCFT_UPDATE_GOLDEN=1 .venv/bin/python -m pytest -q tests/unit/test_launch_golden.py && git diff tests/unit/golden
The sbatch scripts are also checked by `bash -n`.
"""
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from hpcft.errors import ConfigError
from hpcft.launch import profiles
from hpcft.launch.submit import SubmitSpec, render, walltime_seconds
from hpcft.launch.layout import Layout
from hpcft.launch.srun import probe_argv, trainer_argv

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
