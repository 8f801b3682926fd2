"""What `hpcft run` checks before the first launch and once the first snapshot exists: RCCL's network plugin on a
profile that needs one (without it RCCL falls back to TCP sockets and says nothing), and whether the snapshots
and their protection fit the nodes' memory. Each finding is an event; what cannot work stops the run."""
from __future__ import annotations

import getpass
import logging
from collections.abc import Callable, Mapping
from pathlib import Path

from hpcft.errors import ConfigError
from hpcft.launch import memplan, netplugin
from hpcft.launch.config import RunConfig, scheme
from hpcft.launch.profiles import Profile
from hpcft.store.paths import DEFAULT_ROOT, ENV_ROOT, job_dir


class Preflight:
    """One run's checks; `emit(kind, level=…, **fields)` records events (the supervisor's)."""

    def __init__(self, cfg: RunConfig, profile: Profile, environ: Mapping[str, str], emit: Callable[..., None],
                 job_id: str):
        self.cfg, self.profile, self.environ, self.emit = cfg, profile, environ, emit
        self.root = environ.get(ENV_ROOT) or DEFAULT_ROOT
        self.store = job_dir(Path(self.root), job_id, environ.get("USER") or getpass.getuser())
        self._checked_snapshot = False

    def start(self, active_nodes: int) -> dict[str, str]:
        """Before the first launch: the plugin check (returns the variables that point RCCL at an installed plugin)
        and the memory plan for a state size given with --state-bytes (ConfigError when it does not fit)."""
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
        ratio = scheme(cfg).stored_over_state(cfg.group) if cfg.protected else 0.0
        return memplan.plan(state, cfg.keep, cfg.protect, ratio)

    def _memory_before(self) -> None:
        cfg = self.cfg
        if cfg.state_bytes is None:
            self.emit("memory_plan", checked=False, reason="no --state-bytes: checked once the first snapshot exists")
            return
        p = self._plan(cfg.state_bytes)
        capacity, where = self._capacity()
        why = memplan.verdict(p, capacity, cfg.memory_headroom, where)
        if why:
            raise ConfigError(why)
        self.emit("memory_plan", checked=True, needed=p.needed, capacity=capacity, plan=p.line())

    def _capacity(self, used: int = 0) -> tuple[int, str]:
        if self.cfg.node_memory is not None:
            return self.cfg.node_memory, "--node-memory"
        mem = memplan.read_node_memory(self.root)
        return used + mem.usable, f"this node ({memplan.human(mem.shm_free)} free in {self.root}, " \
                                  f"{memplan.human(mem.mem_available)} MemAvailable{', plus the store' if used else ''})"

    def poll(self) -> None:
        """Once this node's trainers have written a snapshot (its size is known now): the same plan with the real
        size, counted against what the node has left; a warning event when it will not fit. Once per run."""
        if self._checked_snapshot:
            return
        state = memplan.snapshot_bytes(self.store) if self.store.is_dir() else None
        if state is None:
            return
        self._checked_snapshot = True
        p = self._plan(state)
        capacity, where = self._capacity(memplan.used_bytes(self.store))
        why = memplan.verdict(p, capacity, self.cfg.memory_headroom, where)
        self.emit("memory_plan", level=logging.WARNING if why else logging.INFO, checked=True, state_bytes=state,
                  needed=p.needed, capacity=capacity, **({"reason": why} if why else {"plan": p.line()}))
