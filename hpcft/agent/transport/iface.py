"""Which address a node agent binds to: a named interface's (hsn0, Frontier's Slingshot NIC), so the bulk traffic
takes the high-speed network; without one, its hostname's address, with a warning event naming the fallback."""
from __future__ import annotations

import fcntl
import logging
import socket
import struct

from hpcft import events

SIOCGIFADDR = 0x8915  # linux/sockios.h


def iface_address(name: str) -> str | None:
    """The IPv4 address of interface `name`, or None when the node has no such interface or it has no address."""
    if name not in {n for _, n in socket.if_nameindex()}:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def choose(iface: str | None, host: str, *, slot: int | None = None) -> tuple[str, str]:
    """(address the other agents reach this one at, address to bind): `iface`'s address for both when it has one;
    else `host` ('auto': the hostname's address), bound on every interface, and an `agent_iface_missing` warning."""
    if iface:
        addr = iface_address(iface)
        if addr:
            return addr, addr
    fallback = socket.gethostbyname(socket.gethostname()) if host == "auto" else host
    if iface:
        events.emit("agent_iface_missing", level=logging.WARNING, iface=iface, node=socket.gethostname(), slot=slot,
                    fallback=fallback, reason=f"no interface {iface} with an IPv4 address on this node: the agents' "
                    "traffic goes over the hostname's network (set --agent-iface to this cluster's fast interface)")
    return fallback, "0.0.0.0"
