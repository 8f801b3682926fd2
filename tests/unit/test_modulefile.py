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


@pytest.mark.skipif(not LMOD_INIT.exists(), reason="Lmod not installed (Debian package lmod)")
def test_module_brings_rocm_and_the_rccl_plugin_where_the_site_has_them(tmp_path):
    """With a site's rocm and rccl-net-plugin modules (fake ones, in a real Lmod tree), `module load hpcft` loads them
    (depends_on); a rocm version the user chose is kept, and unloading hpcft unloads only what it loaded."""
    for name, body in (("rocm/6.4.2", 'setenv("ROCM_PATH", "/opt/rocm-" .. myModuleVersion())'),
                       ("rocm/7.1.1", 'setenv("ROCM_PATH", "/opt/rocm-" .. myModuleVersion())'),
                       ("rccl-net-plugin/1.0", 'prereq("rocm"); setenv("NCCL_NET_PLUGIN", "/sw/lib/librccl-net.so")')):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / f"{name}.lua").write_text(body + "\n")
    script = f"""
set -e
source {LMOD_INIT}
cd {REPO}
module use {tmp_path}
module use modules
module load hpcft
echo "A=$(module -t list 2>&1 | tr '\\n' ' ') PLUGIN=$NCCL_NET_PLUGIN"
module unload hpcft
echo "A_AFTER=$(module -t list 2>&1 | tr '\\n' ' ')"
module load rocm/6.4.2 && module load hpcft
echo "B=$(module -t list 2>&1 | tr '\\n' ' ')"
module unload hpcft
echo "B_AFTER=$(module -t list 2>&1 | tr '\\n' ' ')"
"""
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "A=rocm/7.1.1 rccl-net-plugin/1.0 hpcft/0.1.0  PLUGIN=/sw/lib/librccl-net.so" in out.stdout
    assert "A_AFTER=No modules loaded" in out.stdout
    assert "B=rocm/6.4.2 rccl-net-plugin/1.0 hpcft/0.1.0" in out.stdout
    assert "B_AFTER=rocm/6.4.2 " in out.stdout
