"""The Lmod modulefile, loaded by real Lmod: `module use modules; module load hpcft; hpcft --help`."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LMOD_INIT = Path("/usr/share/lmod/lmod/init/bash")


@pytest.mark.skipif(not LMOD_INIT.exists(), reason="Lmod not installed (Debian package lmod)")
def test_module_load_gives_hpcft():
    script = f"""
set -e
source {LMOD_INIT}
cd {REPO}
module use modules
module load hpcft
echo "ROOT=$HPCFT_ROOT"
echo "WHICH=$(command -v hpcft)"
hpcft --help
module whatis hpcft 2>&1
module unload hpcft
echo "AFTER=${{HPCFT_ROOT:-unset}}"
"""
    # The Python that carries torch comes first on PATH, as a site's python module would put it.
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"ROOT={REPO}" in out.stdout
    assert f"WHICH={REPO}/bin/hpcft" in out.stdout
    assert "Fault-tolerant large-model training" in out.stdout
    assert "Version: 0.1.0" in out.stdout
    assert "AFTER=unset" in out.stdout
