"""The examples (examples/*.py) as a laptop runs them: `python examples/NAME.py --steps 2`, no launcher (one process,
gloo, CPU), ends with exit 0, final.pt and its own snapshots removed; llama.py without transformers says how to get
it; the Frontier batch scripts are what `hpcft submit --dry-run` writes today. (Under `hpcft run` through a node
crash: tests/integration/test_examples.py.)"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpcft.deps import available

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
INSTALL = "pip install 'hpcft[examples]'"
LAUNCHERS = ("HPCFT_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_", "SLURM_", "TORCHELASTIC_")


def _laptop_env(store: Path) -> dict[str, str]:
    """This environment without any launcher's variables (a laptop's shell), its store root in `store`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHERS)}
    return {**env, "HPCFT_STORE_ROOT": str(store), "HPCFT_COPY": "default", "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("name", ["ddp", "tp", "fsdp2", pytest.param("llama", marks=pytest.mark.skipif(
    not available("transformers"), reason=f"llama.py needs transformers: {INSTALL}"))])
def test_an_example_runs_standalone(tmp_path, name):
    store = tmp_path / "store"
    store.mkdir()
    done = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), "--steps", "2", "--out", str(tmp_path)],
                          env=_laptop_env(store), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 2/2 loss" in done.stdout
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert final["step"] == 2 and final["seen"] == {"samples": 16}
    assert final["optim"].keys() == final["params"].keys()  # every parameter has its AdamW state, and no buffer is kept
    assert all(s.keys() == {"step", "exp_avg", "exp_avg_sq"} for s in final["optim"].values())
    assert not list(store.iterdir()), "a finished laptop run leaves no snapshots behind"


def test_llama_without_transformers_says_how_to_install_it():
    hide = ("import runpy, sys; sys.modules['transformers'] = None; sys.argv = ['llama.py']; "
            f"runpy.run_path({str(EXAMPLES / 'llama.py')!r}, run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and INSTALL in done.stderr, done.stderr


def test_the_frontier_batch_scripts_are_current():
    done = subprocess.run([sys.executable, str(EXAMPLES / "frontier" / "generate.py"), "--check"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
