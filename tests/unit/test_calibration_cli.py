"""`hpcft calibrate`, what `hpcft doctor` says of the copy method, and `hpcft run --copy` (config layering, the
trainers' environment)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcft.errors import ConfigError
from hpcft.launch.config import model as config
from hpcft.launch.config import resolve

REPO = Path(__file__).resolve().parents[2]


def hpcft(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "bin" / "hpcft"), *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)


def test_calibrate_measures_caches_and_doctor_shows_where_it_came_from(shm_root: Path):
    env = {"HPCFT_STORE_ROOT": str(shm_root), "HPCFT_COPY": "auto"}
    out = hpcft("doctor", "--json", env=env)
    check = next(c for c in json.loads(out.stdout)["checks"] if c["name"] == "copy method")
    assert check["ok"] and "not calibrated yet" in check["detail"]
    out = hpcft("calibrate", "--json", env=env)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["source"] == "measured" and got["samples"] and got["snapshot"]["chunk_bytes"] == got["restore"]["chunk_bytes"]
    cached = json.loads(hpcft("calibrate", "--json", "--cached", env=env).stdout)
    assert cached["source"] == "cache" and cached["snapshot"] == got["snapshot"] and cached["restore"] == got["restore"]
    check = next(c for c in json.loads(hpcft("doctor", "--json", env=env).stdout)["checks"] if c["name"] == "copy method")
    assert check["ok"] and "(cache: " in check["detail"] and str(shm_root) in check["detail"]
    table = hpcft("calibrate", "--cached", env=env)
    assert table.returncode == 0 and "snapshot: " in table.stdout and "restore_cold" in table.stdout


def test_doctor_names_a_bad_override(shm_root: Path):
    out = hpcft("doctor", "--json", env={"HPCFT_STORE_ROOT": str(shm_root), "HPCFT_COPY": "fast"})
    check = next(c for c in json.loads(out.stdout)["checks"] if c["name"] == "copy method")
    assert not check["ok"] and check["essential"] and "'fast'" in check["detail"] and out.returncode == 1


def test_run_copy_option_layers_and_reaches_the_trainers():
    assert config.load({}, environ={}).launch.copy is None and resolve.copy_env(config.load({}, environ={})) == {}
    from_env = config.load({}, environ={"HPCFT_COPY": "memcpy"})
    assert from_env.launch.copy == "memcpy" and resolve.copy_env(from_env) == {"HPCFT_COPY": "memcpy"}
    assert config.load({"copy": "stream,threads=2"}, environ={"HPCFT_COPY": "memcpy"}).launch.copy == "stream,threads=2"
    for fine in ("auto", "default", "snapshot.threads=1,chunk=4M"):
        assert config.load({"copy": fine}, environ={}).launch.copy == fine
    with pytest.raises(ConfigError, match="HPCFT_COPY: 'threads=0'"):
        config.load({"copy": "threads=0"}, environ={})
