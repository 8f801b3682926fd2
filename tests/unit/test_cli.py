"""The command line: usage errors, exit statuses, doctor's report."""
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def hpcft(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "bin" / "hpcft"), *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)


def test_help_lists_commands():
    out = hpcft("--help")
    assert out.returncode == 0
    for cmd in ("doctor", "sandbox", "bench", "demo"):
        assert cmd in out.stdout


def test_unknown_option_is_usage_error():
    out = hpcft("--bogus")
    assert out.returncode == 2 and "No such option" in out.stderr
    out = hpcft("nonsense")
    assert out.returncode == 2 and "No such command" in out.stderr


def test_doctor_json_and_missing_essential(tmp_path):
    out = hpcft("doctor", "--json", env={"HPCFT_STORE_ROOT": str(tmp_path / "absent")})
    report = json.loads(out.stdout)
    store = next(c for c in report["checks"] if c["name"] == "store")
    assert not store["ok"] and "HPCFT_STORE_ROOT" in store["detail"]
    assert out.returncode == 1 and report["ok"] is False
    torch_check = next(c for c in report["checks"] if c["name"] == "torch")
    assert torch_check["ok"]
    kernel = next(c for c in report["checks"] if c["name"] == "copy kernel")  # make setup built it
    assert kernel["ok"] and "_ntcopy" in kernel["detail"] and not kernel["essential"]


def test_the_cluster_side_commands_start_without_importing_torch():
    """`hpcft run` (the supervisor), the node agents, the janitors and the task wrapper start on every launch and
    every node: importing torch there costs seconds per start (as long again on a loaded node) for nothing they use."""
    for module in ("hpcft.cli", "hpcft.agent.__main__", "hpcft.launch.node.janitor", "hpcft.launch.node.task"):
        probe = f"import sys, {module}; print('torch' in sys.modules)"
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=REPO)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "False", f"importing {module} imports torch"
