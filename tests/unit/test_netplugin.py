"""RCCL's network plugin: found the way RCCL's loader looks for it, in fake library trees (empty .so files in tmp
directories: no ROCm here), and said loudly by `hpcft doctor` and `hpcft run` when it is absent."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcft.doctor import network_checks
from hpcft.launch.config import netplugin
from hpcft.launch.config import profiles
from hpcft.launch.config.model import RunConfig, make
from hpcft.launch.steps.preflight import Preflight

REPO = Path(__file__).resolve().parents[2]


def lib_tree(root: Path, *names: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name in names:
        (root / name).write_bytes(b"")
    return root


def check(checks, name):
    return next(c for c in checks if c.name == name)


def test_rccl_finds_the_plugin_on_ld_library_path(tmp_path):
    lib = lib_tree(tmp_path / "aws-ofi-nccl" / "lib", "librccl-net.so", "libnccl-net.so")
    state = netplugin.resolve({"LD_LIBRARY_PATH": f"/nonexistent:{lib}"})
    assert state.active == str(lib / "librccl-net.so") and "LD_LIBRARY_PATH" in state.how
    assert netplugin.plugin_env(state, {"LD_LIBRARY_PATH": str(lib)}) == {}
    older = lib_tree(tmp_path / "old", "libnccl-net.so")  # RCCL before librccl-net.so loaded libnccl-net.so
    assert netplugin.resolve({"LD_LIBRARY_PATH": str(older)}).active == str(older / "libnccl-net.so")


def test_nccl_net_plugin_as_path_name_and_suffix(tmp_path):
    lib = lib_tree(tmp_path / "lib", "librccl-net-ofi.so")
    path = str(lib / "librccl-net-ofi.so")
    assert netplugin.resolve({"NCCL_NET_PLUGIN": path}).active == path
    assert netplugin.resolve({"NCCL_NET_PLUGIN": "ofi", "LD_LIBRARY_PATH": str(lib)}).active == path
    wrong = netplugin.resolve({"NCCL_NET_PLUGIN": str(tmp_path / "gone.so")})
    assert wrong.active is None and "opens nothing" in wrong.how
    off = netplugin.resolve({"NCCL_NET_PLUGIN": "none", "LD_LIBRARY_PATH": str(lib)})
    assert off.disabled and off.active is None


def test_an_installed_plugin_rccl_would_miss_is_pointed_at(tmp_path):
    lib = lib_tree(tmp_path / "sw" / "lib", "librccl-net-ofi.so", "librccl-net.so", "libfabric.so")
    environ = {netplugin.DIRS_ENV: f"{tmp_path / 'none'}:{lib}", "LD_LIBRARY_PATH": "/opt/rocm/lib"}
    state = netplugin.resolve(environ)
    assert state.active is None and state.installed == str(lib / "librccl-net.so")
    env = netplugin.plugin_env(state, environ)
    assert env == {"NCCL_NET_PLUGIN": str(lib / "librccl-net.so"), "LD_LIBRARY_PATH": f"{lib}:/opt/rocm/lib"}
    # a user's NCCL_NET_PLUGIN is never overridden, even when it opens nothing
    user = {**environ, "NCCL_NET_PLUGIN": "/my/own.so"}
    assert netplugin.plugin_env(netplugin.resolve(user), user) == {}


def test_doctor_says_loudly_when_the_plugin_is_absent(tmp_path):
    empty = lib_tree(tmp_path / "empty")
    checks = network_checks("frontier", {"LD_LIBRARY_PATH": str(empty)})
    plugin = check(checks, "rccl plugin")
    assert plugin.essential and not plugin.ok and "FALL BACK TO TCP SOCKETS" in plugin.detail
    assert "agent iface" in [c.name for c in checks]
    lib = lib_tree(tmp_path / "lib", "librccl-net.so")
    assert check(network_checks("frontier", {"LD_LIBRARY_PATH": str(lib)}), "rccl plugin").ok
    found = check(network_checks("frontier", {netplugin.DIRS_ENV: str(lib)}), "rccl plugin")
    assert found.ok and f"NCCL_NET_PLUGIN={lib / 'librccl-net.so'}" in found.detail
    hooks = check(network_checks("frontier", {"LD_LIBRARY_PATH": str(lib), "FI_MR_CACHE_MONITOR": "memhooks"}),
                  "fi monitor")
    assert hooks.essential and not hooks.ok and "deadlock" in hooks.detail
    assert check(network_checks("cpu", {}), "rccl plugin").ok  # not needed off Frontier


def test_doctor_command_exits_1_without_the_plugin(tmp_path):
    lib = lib_tree(tmp_path / "lib")
    env = {**os.environ, "LD_LIBRARY_PATH": str(lib), "HPCFT_STORE_ROOT": str(tmp_path)}
    env.pop("NCCL_NET_PLUGIN", None)
    env.pop(netplugin.DIRS_ENV, None)
    out = subprocess.run([sys.executable, str(REPO / "bin" / "hpcft"), "doctor", "--profile", "frontier", "--json"],
                         capture_output=True, text=True, env=env, timeout=120)
    report = json.loads(out.stdout)
    plugin = next(c for c in report["checks"] if c["name"] == "rccl plugin")
    assert out.returncode == 1 and not report["ok"] and not plugin["ok"] and plugin["essential"]


@pytest.mark.parametrize("nodes, level", [(4, "ERROR"), (1, "WARNING")])
def test_run_preflight_says_the_plugin_is_missing(tmp_path, nodes, level):
    events = []
    cfg = make(profile="frontier", protect="none")
    environ = {"LD_LIBRARY_PATH": str(lib_tree(tmp_path / "lib")), "USER": "u", "HPCFT_STORE_ROOT": str(tmp_path)}
    env = Preflight(cfg, profiles.FRONTIER, environ, lambda kind, **f: events.append((kind, f)), "7").start(nodes)
    assert env == {}
    kind, fields = next(e for e in events if e[0] == "rccl_plugin")
    assert fields["found"] is False and fields["level"] == getattr(__import__("logging"), level)
    assert "TCP sockets" in fields["action"]


def test_run_preflight_points_rccl_at_an_installed_plugin(tmp_path):
    events = []
    lib = lib_tree(tmp_path / "plugin", "librccl-net.so")
    environ = {netplugin.DIRS_ENV: str(lib), "USER": "u", "HPCFT_STORE_ROOT": str(tmp_path), "LD_LIBRARY_PATH": "/x"}
    env = Preflight(make(profile="frontier", protect="none"), profiles.FRONTIER, environ,
                    lambda kind, **f: events.append((kind, f)), "7").start(2)
    assert env == {"NCCL_NET_PLUGIN": str(lib / "librccl-net.so"), "LD_LIBRARY_PATH": f"{lib}:/x"}
    merged = profiles.env_defaults(profiles.FRONTIER, environ, user="u", job="7", plugin=env)
    assert merged["NCCL_NET_PLUGIN"] == str(lib / "librccl-net.so") and merged["FI_CXI_DEFAULT_CQ_SIZE"] == "131072"
    assert ("rccl_plugin", {"found": True, "path": str(lib / "librccl-net.so"),
                            "how": "hpcft sets NCCL_NET_PLUGIN and LD_LIBRARY_PATH"}) in events
