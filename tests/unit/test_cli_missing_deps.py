"""The command line where optional dependencies are missing (#33): `hpcft --help` and `hpcft doctor` still work, and a
command that needs one ends in a one-line error saying how to install it, never a traceback."""
import importlib
import subprocess
import sys
from pathlib import Path

import click
import pytest

from hpcft.cli import COMMANDS, cli

REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".venv" / "bin" / "python"
# Installed before hpcft is imported: the subprocess behaves as a venv without crc32c, zfec and mpi4py.
BLOCK = """
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"crc32c", "zfec", "mpi4py"}:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Block())
import hpcft.cli
"""


def hpcft_without_deps(*args: str, setup: str = "") -> subprocess.CompletedProcess:
    code = f"{BLOCK}{setup}\nsys.exit(hpcft.cli.main({list(args)!r}))"
    python = str(PYTHON) if PYTHON.exists() else sys.executable
    return subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)


@pytest.mark.parametrize("args, status", [(["--help"], 0), (["run", "--help"], 0), (["doctor"], 1)])
def test_help_and_doctor_work_without_optional_deps(args, status):
    out = hpcft_without_deps(*args)
    assert "Traceback" not in out.stdout + out.stderr
    assert out.returncode == status, out.stderr
    if args == ["doctor"]:
        for name, hint in (("crc32c", "pip install crc32c"), ("zfec", "pip install zfec"), ("mpi4py", "hpcft[mpi]")):
            line = next(line for line in out.stdout.splitlines() if line.split()[1:2] == [name])
            assert hint in line and "not installed" in line
        assert "missing: " in out.stdout and "crc32c, zfec" in out.stdout


@pytest.mark.parametrize("args, setup, hint", [
    (["export", "--help"], "", "pip install crc32c"),  # its module imports the store's checksums
    (["nodep"], "hpcft.cli.COMMANDS['nodep'] = ('hpcft_absent_dep:x', 'X.')", "pip install hpcft_absent_dep"),
])
def test_a_command_missing_a_dependency_is_one_line(args, setup, hint):
    out = hpcft_without_deps(*args, setup=setup)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("hpcft: error: ") and hint in out.stderr


def test_the_help_table_matches_each_commands_own_help():
    """COMMANDS keeps each command's first sentence so `hpcft --help` imports none: it must not drift from the docs."""
    for name, (path, text) in COMMANDS.items():
        module, attr = path.split(":")
        command = getattr(importlib.import_module(module), attr)
        assert command.get_short_help_str(200) == click.Command(name, help=text).get_short_help_str(200), name
    assert sorted(COMMANDS) == cli.list_commands(click.Context(cli))
