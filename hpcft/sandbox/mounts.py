"""What a sandbox node mounts in its own namespace: a private tmpfs on /dev/shm (its memory, lost with it), one on
PMIx's client directory, and its own local disk bound at one path on every node, emptied as a boot empties /tmp."""
import shutil
from dataclasses import dataclass
from pathlib import Path

from hpcft.sandbox.config import Layout


@dataclass(frozen=True)
class NodeMounts:
    """The mounts of one node: tmpfs (source name, options, target) and binds (source, target), for procs.namespaced."""

    tmpfs: list[tuple[str, str, str]]
    binds: list[tuple[Path, str]]


def node_mounts(layout: Layout, name: str, marker: str) -> NodeMounts:
    """Node `name`'s mounts (`marker`: its tmpfs sources' name); its local disk is made here, empty, on the host."""
    tmpfs = [(f"{marker}-shm", f"size={layout.config.shm_size},mode=1777", "/dev/shm"),
             (f"{marker}-pmix", "mode=0755", str(layout.pmix_dir))]
    disk = layout.local_disk(name)
    shutil.rmtree(disk, ignore_errors=True)
    disk.mkdir(parents=True, mode=0o755)
    layout.local_dir.mkdir(mode=0o755, exist_ok=True)
    return NodeMounts(tmpfs, [(disk, str(layout.local_dir))])
