"""What `hpcft run` checks before the first launch and once the first snapshot exists: RCCL's network plugin on a
profile that needs one (without it RCCL falls back to TCP sockets and says nothing), and whether the snapshots
and their protection fit the nodes' memory. Each finding is an event; what cannot work stops the run."""
from __future__ import annotations

import getpass
import logging
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from hpcft import nodemem
from hpcft.errors import ConfigError
from hpcft.launch.config import memplan, netplugin
from hpcft.launch.config.model import RunConfig
from hpcft.launch.config.profiles import Profile
from hpcft.store.paths import DEFAULT_ROOT, ENV_ROOT, job_dir

PLAN_EVERY_S = 5.0  # until the first snapshot exists, the memory plan looks at the nodes' reports this often


class Preflight:
    """One run's checks; `emit(kind, level=…, **fields)` records events (the supervisor's)."""

    def __init__(self, cfg: RunConfig, profile: Profile, environ: Mapping[str, str], emit: Callable[..., None],
                 job_id: str):
        self.cfg, self.profile, self.environ, self.emit = cfg, profile, environ, emit
        self.root = environ.get(ENV_ROOT) or DEFAULT_ROOT
        self.store = job_dir(Path(self.root), job_id, environ.get("USER") or getpass.getuser())
        self._checked_snapshot = False
        self._next_look = 0.0

    def start(self, active_nodes: int) -> dict[str, str]:
        """Before the first launch: RCCL's plugin (the variables pointing at it) and the plan for --state-bytes."""
        env = self._plugin(active_nodes) if self.profile.net_plugin else {}
        self._memory_before()
        return env

    def _plugin(self, active_nodes: int) -> dict[str, str]:
        state = netplugin.resolve(self.environ)
        env = netplugin.plugin_env(state, self.environ)
        if state.active or env:
            self.emit("rccl_plugin", found=True, path=state.active or state.installed,
                      how=state.how if state.active else "hpcft sets NCCL_NET_PLUGIN and LD_LIBRARY_PATH")
            return env
        # one node talks over xGMI only; between nodes RCCL would carry every collective over TCP sockets
        level = logging.ERROR if active_nodes > 1 and not state.disabled else logging.WARNING
        self.emit("rccl_plugin", level=level, found=False, reason=state.summary(),
                  action="RCCL falls back to TCP sockets between nodes, silently: `module load rccl-net-plugin`, or "
                         "set NCCL_NET_PLUGIN to the plugin's librccl-net.so, or list its directory in "
                         f"${netplugin.DIRS_ENV} (see `hpcft doctor --profile {self.profile.name}`)")
        return {}

    def _plan(self, state: int) -> memplan.Plan:
        cfg = self.cfg
        ratio = cfg.protection.scheme().stored_over_state(cfg.protection.group) if cfg.protection.protected else 0.0
        return memplan.plan(state, cfg.memory.keep, cfg.protection.protect, ratio)

    def _memory_before(self) -> None:
        cfg = self.cfg
        if cfg.memory.state_bytes is None:
            self.emit("memory_plan", checked=False, reason="no --state-bytes: checked once the first snapshot exists")
            return
        p = self._plan(cfg.memory.state_bytes)
        capacity, where = self._capacity()
        why = memplan.verdict(p, capacity, cfg.memory.memory_headroom, where)
        if why:
            raise ConfigError(why)
        self.emit("memory_plan", checked=True, needed=p.needed, capacity=capacity, plan=p.line())

    def _capacity(self, figures: Mapping[str, Any] | None = None) -> tuple[int, str]:
        """The memory a node offers the store: --node-memory, else the store's free bytes and MemAvailable (those of
        `figures`, a node's report, plus what its store holds already; else this node's, before the launch)."""
        if self.cfg.memory.node_memory is not None:
            return self.cfg.memory.node_memory, "--node-memory"
        f = figures or {"shm_free": nodemem.fs_free(self.root), "mem_available": nodemem.mem_available(),
                        "store_bytes": 0, "node": "this node"}
        used = f.get("store_bytes") or 0
        return used + min(f["shm_free"], f["mem_available"]), (
            f"{f.get('node') or 'a node'} ({memplan.human(f['shm_free'])} free in its store's file system, "
            f"{memplan.human(f['mem_available'])} MemAvailable"
            + (f", {memplan.human(used)} in the store)" if used else ")"))

    def poll(self, reports: Callable[[], Iterable[Mapping[str, Any]]] = lambda: (), now: bool = False,
             expected: int | None = None) -> None:
        """Once the trainers wrote a snapshot: the memory plan with its real size on every reporting node (`reports()`:
        the agents'; without them, this node's store) against what each has left, a warning naming the tightest one.
        Once per run, looked at every PLAN_EVERY_S; it waits for all `expected` nodes unless `now` (launch over)."""
        if self._checked_snapshot or (time.monotonic() < self._next_look and not now):
            return
        self._next_look = time.monotonic() + PLAN_EVERY_S
        nodes = [r for r in reports() if r.get("snapshot_bytes")]
        if not nodes and self.store.is_dir():
            nodes = [{**nodemem.figures(self.store), "node": socket.gethostname()}]
        nodes = [r for r in nodes if r.get("snapshot_bytes")]
        if not nodes or (expected and len(nodes) < expected and not now):
            return
        self._checked_snapshot = True
        verdicts = []
        for figures in nodes:
            p = self._plan(int(figures["snapshot_bytes"]))
            capacity, where = self._capacity(figures)
            why = memplan.verdict(p, capacity, self.cfg.memory.memory_headroom, where)
            verdicts.append((capacity - p.needed, p, capacity, why))
        _, p, capacity, why = min(verdicts, key=lambda v: v[0])
        self.emit("memory_plan", level=logging.WARNING if why else logging.INFO, checked=True, nodes=len(nodes),
                  **({"expected": expected} if expected and len(nodes) < expected else {}), state_bytes=p.state,
                  needed=p.needed, capacity=capacity, **({"reason": why} if why else {"plan": p.line()}))
