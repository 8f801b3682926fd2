"""Which network plugin RCCL would load (aws-ofi-nccl for ROCm), as RCCL's loader decides (ROCm/rccl
src/plugin/plugin_open.cc), and where one is installed when RCCL would not find it: without one RCCL sends inter-node
traffic over TCP sockets, said only at NCCL_DEBUG=INFO, which does not scale. Pure: the file system is injected."""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_NAMES = ("librccl-net.so", "libnccl-net.so")  # what RCCL dlopens without NCCL_NET_PLUGIN (newer, older)
PREFIXES = ("librccl-net", "libnccl-net")  # an installed plugin: librccl-net.so, librccl-net-ofi.so, libnccl-net.so …
SYSTEM_DIRS = ("/lib64", "/usr/lib64", "/lib", "/usr/lib")  # dlopen's defaults after LD_LIBRARY_PATH
DIRS_ENV = "HPCFT_RCCL_PLUGIN_DIRS"  # a site's plugin directories (':'-separated), besides the config file's


@dataclass(frozen=True)
class PluginState:
    """`active`: the library RCCL would load as the environment stands (None: none); `how`: why (or why not);
    `installed`: a plugin found in a known directory that RCCL would not load as things stand."""
    active: str | None
    how: str
    installed: str | None = None
    disabled: bool = False  # NCCL_NET_PLUGIN=none: the user turned it off

    def summary(self) -> str:
        """One line for doctor and the run's events."""
        if self.active:
            return f"RCCL loads {self.active} ({self.how})"
        if self.disabled:
            return f"disabled by {self.how}: RCCL uses TCP sockets between nodes"
        where = f"; installed at {self.installed}" if self.installed else ""
        return f"RCCL would find no network plugin ({self.how}){where}"


def search_dirs(environ: Mapping[str, str]) -> list[str]:
    """Where dlopen looks for a bare name: LD_LIBRARY_PATH, then the system directories (ld.so.cache is not read)."""
    return [d for d in environ.get("LD_LIBRARY_PATH", "").split(":") if d] + list(SYSTEM_DIRS)


def known_dirs(environ: Mapping[str, str], extra: Iterable[str] = ()) -> list[str]:
    """The site's plugin directories: $HPCFT_RCCL_PLUGIN_DIRS, then `extra` (the config file's [site] plugin_dirs)."""
    return [d for d in environ.get(DIRS_ENV, "").split(":") if d] + [d for d in extra if d]


def _open(name: str, dirs: Sequence[str], isfile: Callable[[str], bool]) -> str | None:
    """The file dlopen(name) would open: `name` itself when it holds a '/', else the first match in `dirs`."""
    if "/" in name:
        return name if isfile(name) else None
    return next((str(Path(d) / name) for d in dirs if isfile(str(Path(d) / name))), None)


def _installed(dirs: Sequence[str], listdir: Callable[[str], list[str]]) -> str | None:
    """The first plugin library in `dirs` (librccl-net.so before its variants before libnccl-net*)."""
    for d in dirs:
        try:
            names = listdir(d)
        except OSError:
            continue
        found = sorted((n for n in names if n.startswith(PREFIXES) and n.endswith(".so")),
                       key=lambda n: (not n.startswith(PREFIXES[0]), n != "librccl-net.so", n))
        if found:
            return str(Path(d) / found[0])
    return None


def resolve(environ: Mapping[str, str], extra_dirs: Iterable[str] = (), *,
            isfile: Callable[[str], bool] = os.path.isfile,
            listdir: Callable[[str], list[str]] = os.listdir) -> PluginState:
    """What RCCL would do with `environ`: NCCL_NET_PLUGIN names a library (a path, a name on the search path, or a
    suffix: `ofi` → librccl-net-ofi.so; `none` turns plugins off); unset, RCCL tries librccl-net.so (then, in older
    RCCL, libnccl-net.so) on the search path. When nothing would load, the known directories are searched."""
    dirs = search_dirs(environ)
    value = environ.get("NCCL_NET_PLUGIN", "")
    if value.lower() == "none":
        return PluginState(None, "NCCL_NET_PLUGIN=none", disabled=True)
    if value:
        names = [value]
        if "/" not in value and not (value.startswith("lib") and value.endswith(".so")):
            names.append(f"librccl-net-{value}.so")
        how = f"NCCL_NET_PLUGIN={value}"
    else:
        names, how = list(DEFAULT_NAMES), "librccl-net.so on LD_LIBRARY_PATH or the system library path"
    for name in names:
        path = _open(name, dirs, isfile)
        if path:
            return PluginState(path, how)
    found = _installed(known_dirs(environ, extra_dirs), listdir)
    return PluginState(None, (how + " opens nothing") if value else "no librccl-net.so on LD_LIBRARY_PATH", found)


def plugin_env(state: PluginState, environ: Mapping[str, str]) -> dict[str, str]:
    """What points RCCL at a plugin that is installed but would not be loaded: NCCL_NET_PLUGIN (OLCF's preferred
    way) and its directory prepended to LD_LIBRARY_PATH. Nothing when RCCL finds one already or the user set
    NCCL_NET_PLUGIN (even to something that opens nothing: a user's value is never overridden)."""
    if state.active or state.installed is None or environ.get("NCCL_NET_PLUGIN"):
        return {}
    lib_dir = str(Path(state.installed).parent)
    old = environ.get("LD_LIBRARY_PATH", "")
    path = old if lib_dir in old.split(":") else ":".join(p for p in (lib_dir, old) if p)
    return {"NCCL_NET_PLUGIN": state.installed, "LD_LIBRARY_PATH": path}
