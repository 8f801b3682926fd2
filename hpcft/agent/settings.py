"""What a node agent is told (`AgentConfig`): the settings every agent of a launch shares, written once as JSON, and
its own place in the launch, derived on its node."""
from __future__ import annotations

import json
import types
import typing
from dataclasses import asdict, dataclass, fields, is_dataclass
from typing import Any

from hpcft.agent.protection.pins import LEASE_S
from hpcft.agent.protection.placement import Scheme
from hpcft.agent.transport.heartbeat import LOSS_TIMEOUT_S
from hpcft.agent.transport.throttle import CPU_SHARE
from hpcft.durable.settings import PersistConfig
from hpcft.errors import ConfigError
from hpcft.store.paths import slot_ranks

NODE_FIELDS = ("job_id", "slot", "slots", "secret", "bind", "tag", "rebuild", "root")  # derived on the node


@dataclass(frozen=True)
class AgentConfig:
    """Everything one agent needs: the launch's settings (`to_json`: the same on every node), then what its node
    derives (`NODE_FIELDS`: `python -m hpcft.agent` sets them from its flags, the layout and the node's name)."""
    rendezvous: str  # directory shared by the nodes for addresses and status
    secret_file: str | None = None  # the job secret's file (None: $HPCFT_SECRET_FILE)
    layout: tuple[str, ...] = ()  # the active nodes in slot order: a node finds its slot there by its name
    host: str = "127.0.0.1"  # the address the others reach this agent at ('auto': its hostname's); chosen on the node
    iface: str | None = None  # the interface to bind to and be reached at (e.g. hsn0; a node without it uses `host`)
    scheme: Scheme = Scheme()
    rate: float | None = None  # bytes/s cap on protection traffic
    rounds: int = 1  # protection rounds before exiting (0: until stopped)
    interval: float = 1.0  # seconds between protection rounds
    timeout: float = 120.0  # seconds to wait for the other agents
    nice: int = 10  # CPU priority increment, its session's autogroup too (transport/autogroup.Below): below trainers
    pin_lease: float = LEASE_S  # seconds a pin outlives the agent's last renewal
    cpu_share: float = CPU_SHARE  # cap on the agent's CPU time: this fraction of its cores, on average (0: none)
    cpu_cores: float | None = None  # the CPU cap in cores, instead of cpu_share (see launch/config/profiles.py)
    persist: PersistConfig = PersistConfig()  # the durable tier (no flushing without a directory)
    lag_bound: int | None = None  # protection lag (steps) the CPU cap is raised to keep to (see protection/budget.py)
    lag_cores: float = 1.0  # the most cores a lag bound may raise the cap to (`hpcft run`: protection/budget.ceiling)
    loss_timeout: float = LOSS_TIMEOUT_S  # seconds of silence after which a peer is a suspect (0: no heartbeats)
    transport: str = "tcp"  # the mesh's carrier: tcp, or mpi (transport/mpimesh.py; the heartbeats stay on TCP)
    tasks_per_node: int = 0  # the ranks a slot runs (store.paths.slot_ranks); 0: every rank directory on the node
    job_id: str = ""
    slot: int = 0
    slots: int = 1
    secret: bytes = b""
    bind: str = "0.0.0.0"  # the address the agent listens on (its iface's address, or every interface)
    tag: str = "0"  # the launch (restart count) keeping relaunches apart
    rebuild: bool = False  # first rebuild what replaced nodes lost
    root: str | None = None  # the store root of a hosted agent, standing in for a lost slot (None: the node's)

    def __post_init__(self) -> None:
        if self.transport not in ("tcp", "mpi"):
            raise ConfigError(f"agent settings: transport {self.transport!r} is neither tcp nor mpi")

    @property
    def ranks(self) -> range | None:
        """The ranks whose snapshots this node protects in this launch (None: every rank directory in its store)."""
        return slot_ranks(self.slot, self.tasks_per_node) if self.tasks_per_node else None

    def to_json(self) -> str:
        """The launch's settings as one JSON object (not the node's own fields)."""
        return json.dumps({k: v for k, v in asdict(self).items() if k not in NODE_FIELDS}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "AgentConfig":
        """The settings `to_json` wrote; ConfigError naming a key that is unknown, a node's own, or mistyped."""
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"agent settings are not JSON: {exc}") from None
        return _build(cls, data, "", NODE_FIELDS)


def _build(cls: type, data: Any, where: str, hidden: tuple[str, ...] = ()) -> Any:
    """A `cls` dataclass from a JSON object (but its `hidden` fields), each value checked against its field's type."""
    if not isinstance(data, dict):
        raise ConfigError(f"agent settings: {where or 'the settings'} must be a JSON object")
    hints, names = typing.get_type_hints(cls), [f.name for f in fields(cls) if f.name not in hidden]
    for key in data:
        if key not in names:
            raise ConfigError(f"agent settings: unknown key {where + key!r}; valid: {', '.join(names)}")
    return cls(**{k: _typed(where + k, v, hints[k]) for k, v in data.items()})


def _typed(key: str, value: Any, hint: Any) -> Any:
    """`value` as the type `hint` (a JSON list as a tuple, an integer as a float); ConfigError naming `key`."""
    if is_dataclass(hint):
        return _build(hint, value, f"{key}.")
    kinds = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    for kind in kinds:
        if kind is float and type(value) is int:
            return float(value)
        if typing.get_origin(kind) is tuple and isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(value)
        if isinstance(kind, type) and type(value) is kind:
            return value
    names = " or ".join(k.__name__ if isinstance(k, type) else str(k) for k in kinds)
    raise ConfigError(f"agent settings: {key}={value!r} is not of type {names}")
