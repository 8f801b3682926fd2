"""A site's settings for the batch script (`[site]` in the config file): the module lines that come before
`module load hpcft` (PrgEnv, rocm, the RCCL plugin, craype-accel…), the lines that set up the Python environment,
node-local NVMe, and where the RCCL network plugin is installed."""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from hpcft.errors import ConfigError
from hpcft.launch.config.model import read_toml

_MODULE = re.compile(r"[\w./+-]+")
_PATH = re.compile(r"[\w./${}-]+")  # a path that may name $USER (expanded by the batch shell)


@dataclass(frozen=True)
class SiteConfig:
    """The config file's [site] table."""
    modules: tuple[str, ...] | None = None  # loaded in this order before hpcft's (None: the profile's; []: none)
    setup: tuple[str, ...] = ()  # shell lines after them, e.g. `source activate /path/to/env` (with torch)
    nvme: bool = False  # ask for node-local NVMe by default (`hpcft submit --nvme`)
    nvme_constraint: str = "nvme"  # the sbatch constraint that gives it (Frontier: nvme)
    nvme_dir: str = "/mnt/bb/$USER"  # where it is on a node (Frontier's), exported as HPCFT_NVME
    plugin_dirs: tuple[str, ...] = ()  # where the RCCL network plugin is, exported as HPCFT_RCCL_PLUGIN_DIRS

    def __post_init__(self) -> None:
        for name in self.modules or ():
            if not _MODULE.fullmatch(name):
                raise ConfigError(f"site module {name!r} is not a module name "
                                  "(letters, digits, '_', '.', '/', '+', '-')")
        for line in self.setup:
            if "\n" in line or not line.strip():
                raise ConfigError(f"site setup line {line!r} must be one non-empty line")
        for path in (self.nvme_dir, *self.plugin_dirs):
            if not _PATH.fullmatch(path):
                raise ConfigError(f"site path {path!r} may use letters, digits, '_', '.', '/', '-' and $VARS only")
        if not _MODULE.fullmatch(self.nvme_constraint):
            raise ConfigError(f"nvme_constraint {self.nvme_constraint!r} is not a Slurm feature name")


_KEYS = {f.name for f in fields(SiteConfig)}


def from_mapping(data: Mapping[str, Any], where: str) -> SiteConfig:
    """SiteConfig from a parsed [site] table; unknown keys and wrong types are errors naming them."""
    unknown = set(data) - _KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown [site] key(s) {', '.join(sorted(unknown))}; "
                          f"valid: {', '.join(sorted(_KEYS))}")
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key in ("modules", "setup", "plugin_dirs"):
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"{where}: [site] {key} must be a list of strings")
            value = tuple(value)
        elif key == "nvme" and not isinstance(value, bool):
            raise ConfigError(f"{where}: [site] nvme must be true or false")
        elif key != "nvme" and not isinstance(value, str):
            raise ConfigError(f"{where}: [site] {key} must be a string")
        values[key] = value
    return SiteConfig(**values)


def load(config_file: str | os.PathLike | None = None, environ: Mapping[str, str] | None = None) -> SiteConfig:
    """The [site] table of `config_file` (or $HPCFT_CONFIG); defaults when there is none."""
    env = os.environ if environ is None else environ
    path = config_file or env.get("HPCFT_CONFIG")
    if not path:
        return SiteConfig()
    p = Path(path)
    table = read_toml(p).get("site", {})
    if not isinstance(table, dict):
        raise ConfigError(f"config file {p}: site must be a table ([site])")
    return from_mapping(table, f"config file {p}")
