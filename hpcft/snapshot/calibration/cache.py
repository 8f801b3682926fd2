"""The calibration's measurements, kept per host in one small file at the store root: node-local memory, the memory
measured, where a shared home directory would have thousands of ranks read and write one file at start-up. It does
not outlive a reboot: the next job measures again (under two seconds, one rank per node; the others wait on a lock).

The measurements are kept, not the decision (the policy runs on every read). An entry is used only where its key
(host, CPU, cores, kernel build, copy library) is this process's; a file that cannot be read, parsed or trusted
(another user's, a symlink, the wrong mode) is measured around, never believed."""
from __future__ import annotations

import contextlib
import fcntl
import getpass
import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Iterator

from hpcft.env import usable_cores
from hpcft.errors import StoreError
from hpcft.snapshot.calibration.policy import Sample
from hpcft.store import ntcopy, paths
from hpcft.store.checksum import crc32c

FORMAT = 1  # bump when what is measured changes: older entries then no longer match any key
KEEP = 8  # entries per file (one per key: e.g. ranks bound to different numbers of cores)


def cache_path(root: str | os.PathLike | None = None) -> Path:
    """`<store root>/.hpcft-<user>-copy.json` (a dot file: the prolog's sweep of `hpcft-<user>-<job>` skips it)."""
    return paths.resolve_root(root) / f".hpcft-{paths.safe(getpass.getuser())}-copy.json"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _kernel_library() -> str:
    """What copies with streaming stores here: the built library's crc32c, or why there is none."""
    path = ntcopy.kernel_path()
    if path is None or not ntcopy.available():
        return f"none ({ntcopy.reason})"
    return f"{crc32c(path.read_bytes()):08x}"


def host_key() -> dict[str, Any]:
    """What a measurement holds for: the same key, the same machine as far as copying goes."""
    return {"format": FORMAT, "host": platform.node(), "cpu": cpu_model(), "cores": os.cpu_count(),
            "usable_cores": usable_cores(), "os_kernel": f"{platform.release()} {platform.version()}",
            "copy_kernel": _kernel_library()}


def read(path: Path, key: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """The entry for `key` (its samples as `Sample`s under "samples") and "", or None and why not."""
    try:
        raw = paths.read_file(path)
    except StoreError as exc:
        return None, "no cache file yet" if not path.exists() and not path.is_symlink() else str(exc)
    try:
        entries = _entries(json.loads(raw))
    except (ValueError, TypeError, AttributeError) as exc:  # not JSON, or JSON of another shape
        return None, f"cache file {path} is unusable ({exc}); measured again"
    for entry in entries:
        if entry.get("key") == key:
            try:
                return {**entry, "samples": [Sample.from_dict(s) for s in entry["samples"]]}, ""
            except (ValueError, TypeError, KeyError) as exc:
                return None, f"cache file {path}: an entry for this host is unusable ({exc}); measured again"
    return None, f"cache file {path} holds no measurement for this host as it is now (host, CPU, cores, kernel)"


def _entries(data: Any) -> list[dict[str, Any]]:
    if data.get("format") != FORMAT or not isinstance(data.get("entries"), list):
        raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
    return [e for e in data["entries"] if isinstance(e, dict)]


def write(path: Path, key: dict[str, Any], samples: list[Sample], seconds: float) -> None:
    """Record `samples` for `key` (replacing its older entry, keeping the KEEP newest others), atomically.
    StoreError where the file cannot be written (the caller goes on with what it measured)."""
    try:
        others = [e for e in _entries(json.loads(paths.read_file(path))) if e.get("key") != key]
    except (StoreError, ValueError, TypeError, AttributeError):
        others = []
    entry = {"key": key, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
             "seconds": round(seconds, 3), "load_average": [round(x, 2) for x in os.getloadavg()],
             "samples": [s.as_dict() for s in samples]}
    data = {"format": FORMAT, "entries": [*others[-(KEEP - 1):], entry]}
    try:
        paths.replace_file(path, json.dumps(data, indent=1).encode(), path.with_name(f"{path.name}.{os.getpid()}"))
    except OSError as exc:
        raise StoreError(f"cannot write the calibration cache {path}: {exc.strerror or exc}") from exc


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold `<path>.lock` exclusively: the ranks of one node measure once, not all at the same time (their copies
    would measure each other). StoreError where the lock file cannot be had."""
    fd = paths.open_file(path.with_name(path.name + ".lock"), os.O_RDWR, create=True)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
