"""The machine profile from the machine (`hpcft run`, `hpcft submit` and `hpcft doctor` without --profile): the site's
name for itself in the environment, else the node's GPUs; and the check that a profile fits the node it runs on."""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hpcft.errors import ConfigError

# Where a site names itself: Slurm's cluster name in every job (SLURM_CLUSTER_NAME), and OLCF's Lmod system name,
# set on its login and compute nodes alike (LMOD_SYSTEM_NAME, the one `hpcft submit` on a login node can see).
SITE_VARS = ("SLURM_CLUSTER_NAME", "LMOD_SYSTEM_NAME")
SITES = {"frontier": "frontier"}  # a site's name for itself -> its profile
GPU_PROFILES = ("frontier", "cuda")
CHECK_ENV = "HPCFT_PROFILE_CHECK"  # the `profile_check` option's variable, named in the errors


@dataclass(frozen=True)
class Devices:
    """The GPUs a node's /dev shows: AMD's (render nodes beside /dev/kfd, one per GCD) and NVIDIA's."""
    amd: int = 0
    nvidia: int = 0

    @property
    def gpus(self) -> int:
        return self.amd + self.nvidia

    def said(self) -> str:
        kinds = [f"{n} {kind}" for n, kind in ((self.amd, "AMD (ROCm)"), (self.nvidia, "NVIDIA")) if n]
        return " and ".join(kinds) + " GPU(s)" if kinds else "no GPU"


def devices(dev: Path = Path("/dev")) -> Devices:
    """What this node's `dev` directory shows (device files exist whatever the devices cgroup lets a step open)."""
    amd = len(list(dev.glob("dri/renderD*"))) if (dev / "kfd").exists() else 0
    nvidia = sum(1 for p in dev.glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name))
    return Devices(amd, nvidia)


def detect(environ: Mapping[str, str], found: Devices | None) -> tuple[str, str]:
    """(profile, why): the site's profile where the environment names a known site, else `cuda` (a generic GPU
    node: one task per GPU) where `found` shows GPUs, else `cpu`. `found` None: the node is not the one that
    trains (a login node submitting), so only the environment counts."""
    for var in SITE_VARS:
        name = environ.get(var, "").strip().lower()
        if name in SITES:
            return SITES[name], f"{var}={name}"
    if found is not None and found.gpus:
        return "cuda", f"{found.said()} on this node and no known site in {' or '.join(SITE_VARS)}"
    return "cpu", ("no GPU on this node" if found is not None else "no known site in " + " or ".join(SITE_VARS))


def check_fits(profile: str, found: Devices) -> None:
    """ConfigError when the profile and the node disagree: GPU trainers on a node without GPUs, or CPU trainers on a
    GPU node (the GPUs would sit idle), naming the profile to choose and the override (`--profile-check off`)."""
    if profile in GPU_PROFILES and not found.gpus:
        raise ConfigError(f"profile {profile} trains on GPUs, but this node shows {found.said()} in /dev: run inside "
                          "an allocation of GPU nodes, or choose --profile cpu; --profile-check off "
                          f"({CHECK_ENV}=0) forces it")
    if profile == "cpu" and found.gpus:
        right = "frontier (on Frontier) or cuda" if found.amd else "cuda"
        raise ConfigError(f"profile cpu trains on the CPU, but this node has {found.said()}: choose --profile "
                          f"{right} (or leave --profile out to detect it); --profile-check off ({CHECK_ENV}=0) "
                          "forces cpu")
