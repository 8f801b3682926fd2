"""Network namespaces for the sandbox: a controller namespace holding a bridge, one namespace per node. Nothing is
created outside them: no address or interface is visible on the host, no packet leaves the machine."""
import subprocess
from collections.abc import Sequence
from pathlib import Path

from hpcft.errors import SandboxError

_BRIDGE = "br0"


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SandboxError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")


def exists(name: str) -> bool:
    """True if the named network namespace exists."""
    return Path("/run/netns", name).exists()


def add(name: str) -> None:
    """Create an empty network namespace; refuse one that exists (it is not ours to take over)."""
    if exists(name):
        raise SandboxError(f"network namespace {name} exists already (left by a sandbox whose state was lost?): "
                           f"remove it with `ip netns del {name}`")
    _ip("netns", "add", name)
    _ip("-n", name, "link", "set", "lo", "up")


def setup_controller(name: str, addr: str) -> None:
    """The controller's namespace gets a bridge at `addr`/24 that every node plugs into."""
    _ip("-n", name, "link", "add", _BRIDGE, "type", "bridge")
    _ip("-n", name, "addr", "add", f"{addr}/24", "dev", _BRIDGE)
    _ip("-n", name, "link", "set", _BRIDGE, "up")


def setup_node(name: str, controller: str, node: str, addr: str) -> None:
    """A node's namespace gets eth0 at `addr`/24, a veth whose peer is on the controller's bridge."""
    _ip("-n", controller, "link", "add", f"v-{node}", "type", "veth", "peer", "name", "eth0", "netns", name)
    _ip("-n", controller, "link", "set", f"v-{node}", "master", _BRIDGE, "up")
    _ip("-n", name, "addr", "add", f"{addr}/24", "dev", "eth0")
    _ip("-n", name, "link", "set", "eth0", "up")


def delete(names: Sequence[str]) -> None:
    """Remove the named namespaces that exist (their veths and the bridge go with them)."""
    for name in names:
        if exists(name):
            _ip("netns", "del", name)
