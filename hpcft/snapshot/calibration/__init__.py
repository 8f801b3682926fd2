"""The copy method of the CPU snapshot and restore, chosen on the machine (docs/reference/checkpointing.md, "Copy
calibration"): HPCFT_COPY pins it (`hpcft run --copy`); else a short measurement (`measure`) cached per host (`cache`)
and a pure policy over it (`policy`). Device backends keep their own copy logic."""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from hpcft.errors import ConfigError, StoreError
from hpcft.snapshot.calibration import cache, measure
from hpcft.snapshot.calibration.policy import Choice, Method, Sample, default_choice, parse_override, pick
from hpcft.store import ntcopy

_log = logging.getLogger(__name__)
ENV = "HPCFT_COPY"
AUTO = ("", "auto")
DEFAULT = "default"


@dataclass(frozen=True)
class Resolved:
    """The choice and where it came from (for `hpcft doctor`, the benches and the logs)."""

    choice: Choice
    source: str  # "override", "cache", "measured", "default"
    detail: str
    samples: tuple[Sample, ...] = field(default=(), repr=False)

    def summary(self) -> str:
        c = self.choice
        return f"snapshot {c.snapshot.describe()}; restore {c.restore.describe()} ({self.source}: {self.detail})"

    def as_dict(self) -> dict:
        return {**self.choice.as_dict(), "source": self.source, "detail": self.detail,
                "samples": [s.as_dict() for s in self.samples]}


_memo: dict[tuple, Resolved] = {}
_lock = threading.Lock()


def resolve(default_threads: int, *, environ: Mapping[str, str] | None = None, path: Path | None = None,
            measure_now: bool = True, force: bool = False) -> Resolved:
    """The copy method for this process: HPCFT_COPY's when set (`default`: the built-in method), else this host's
    cached measurement, else a new one (with `measure_now` False, as `hpcft doctor` asks: the built-in method).
    Remembered per process; `force` measures again. ConfigError for an HPCFT_COPY that cannot be used."""
    env = os.environ if environ is None else environ
    text = env.get(ENV, "").strip()
    base = default_choice(default_threads, ntcopy.kernels()[0])
    if text.lower() == DEFAULT:
        return Resolved(base, "override", f"{ENV}=default: hpcft's built-in method, not calibrated")
    if text.lower() not in AUTO:
        return Resolved(parse_override(text, base), "override", f"{ENV}={text}")
    try:
        where = path or cache.cache_path()
    except ConfigError as exc:  # no store root: nothing to measure on nor to cache in
        return Resolved(base, "default", f"not calibrated: {exc}")
    memo_key = (str(where), default_threads, measure_now)
    with _lock:
        if not force and memo_key in _memo:
            return _memo[memo_key]
        got = _calibrated(where, base, measure_now, force)
        if got.source != "default" or not measure_now:
            _memo[memo_key] = got
        return got


def _calibrated(path: Path, base: Choice, measure_now: bool, force: bool) -> Resolved:
    key = cache.host_key()
    try:
        with cache.locked(path):
            entry, why = (None, "measured again on request") if force else cache.read(path, key)
            if entry is not None:
                return Resolved(pick(entry["samples"], base), "cache",
                                f"{path}, measured {entry.get('measured_at')} in {entry.get('seconds')} s "
                                f"(load average then {entry.get('load_average')})", tuple(entry["samples"]))
            if not measure_now:
                return Resolved(base, "default", f"not calibrated yet on this host ({why}); the first Checkpointer "
                                                 "measures it, or run `hpcft calibrate`")
            return _measured(path, key, base, why)
    except StoreError as exc:  # the lock file is not ours, the root is read-only, ...
        _log.warning("hpcft: copy calibration: %s; hpcft's built-in copy method is used", exc)
        return Resolved(base, "default", f"not calibrated: {exc}")


def _measured(path: Path, key: dict, base: Choice, why: str) -> Resolved:
    t0 = time.perf_counter()
    try:
        samples = measure.measure(path.parent, key["usable_cores"])
    except OSError as exc:  # no room for the scratch buffers, ...
        _log.warning("hpcft: copy calibration failed (%s); hpcft's built-in copy method is used", exc)
        return Resolved(base, "default", f"calibration failed: {exc}")
    seconds = time.perf_counter() - t0
    choice = pick(samples, base)
    detail = f"measured now in {seconds:.2f} s ({why})"
    try:
        cache.write(path, key, samples, seconds)
        detail += f", cached in {path}"
    except StoreError as exc:
        _log.warning("hpcft: %s; the calibration is used by this process only", exc)
        detail += f", not cached ({exc})"
    _log.info("hpcft: copy calibration: snapshot %s, restore %s (%s)", choice.snapshot.describe(),
              choice.restore.describe(), detail)
    return Resolved(choice, "measured", detail, tuple(samples))


@dataclass(frozen=True)
class CopySettings:
    """What a Checkpointer copies with, and where it came from; a chunk size of 0 means the backend's own."""

    snapshot: Method
    restore: Method
    resolved: Resolved | None


def settings(backend: str, default_threads: int, threads: int | None = None,
             chunk_bytes: int | None = None) -> CopySettings:
    """The methods for a Checkpointer on `backend`: calibrated on the CPU backend, explicit `threads` and `chunk_bytes`
    winning; device backends keep their own (`default_threads` checksum threads, their chunk, the streaming kernel)."""
    if backend != "cpu":
        m = Method("stream", threads or default_threads, chunk_bytes or 0)
        return CopySettings(m, m, None)
    got = resolve(default_threads)
    snap, rest = got.choice.snapshot, got.choice.restore
    chunk = chunk_bytes or snap.chunk_bytes
    return CopySettings(Method(snap.kernel, threads or snap.threads, chunk),
                        Method(rest.kernel, threads or rest.threads, chunk), got)


__all__ = ["ENV", "CopySettings", "Resolved", "resolve", "settings"]
