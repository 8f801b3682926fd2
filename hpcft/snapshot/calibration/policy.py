"""Which copy method the CPU snapshot and restore use: pure functions over plain measurements.

A method is a copy kernel (`fused`: streaming-store copy with the crc32c in the same pass; `stream`: streaming-store
copy, then the checksum; `memcpy`: libc's, then the checksum), a thread count and a chunk size. The restore reads the
chunk grid the snapshot wrote, so the chunk size is one choice for both; kernel and threads are chosen per direction.
A method that failed its probe is never chosen; among methods within the noise margin of the fastest, the cheapest
is: fewer threads, then the kernel in `KERNELS` order, then the chunk nearest the built-in default."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Sequence

from hpcft.errors import ConfigError
from hpcft.store.ntcopy import KERNELS

DEFAULT_CHUNK = 1 << 20  # hpcft's chunk before calibration (see copiers.cpu.CpuCopier.chunk_bytes)
CHUNK_RANGE = (64 << 10, 256 << 20)
MARGIN = 0.05  # relative: measurements closer than this to the fastest count as ties
# the measured cases behind each choice: a restore is a relaunch's (cold: pages not yet mapped) as often as a
# warm one's, so both count alike
CASES = {"snapshot": ("snapshot",), "restore": ("restore", "restore_cold")}
OVERRIDE_HELP = ("write e.g. HPCFT_COPY=stream,threads=2,chunk=1M (both directions), "
                 "HPCFT_COPY=snapshot.threads=2,restore.kernel=memcpy, HPCFT_COPY=default (hpcft's built-in "
                 "method, no calibration) or HPCFT_COPY=auto (calibrate once per host, cached)")


@dataclass(frozen=True)
class Method:
    """How one direction copies: the kernel, the workers (the calling thread is one), the chunk size."""

    kernel: str
    threads: int
    chunk_bytes: int

    def describe(self) -> str:
        plural = "s" if self.threads != 1 else ""
        return f"{self.kernel}, {self.threads} thread{plural}, {_size_text(self.chunk_bytes)} chunks"


@dataclass(frozen=True)
class Sample:
    """`seconds` to copy and checksum `nbytes` in `case` (snapshot, restore, restore_cold) with `method`, the best of
    the repeats; None when the method could not run here (`why`)."""

    case: str
    method: Method
    seconds: float | None
    nbytes: int
    why: str = ""

    @property
    def gbps(self) -> float | None:
        return self.nbytes / self.seconds / 1e9 if self.seconds else None

    def as_dict(self) -> dict[str, Any]:
        return {"case": self.case, **asdict(self.method), "seconds": self.seconds, "nbytes": self.nbytes,
                "why": self.why}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Sample":
        """The inverse of `as_dict`; ValueError (naming the field) on anything else (a cache file's contents)."""
        method = Method(_kernel(d.get("kernel")), _count(d, "threads"), _count(d, "chunk_bytes"))
        seconds = d.get("seconds")
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                    or not seconds > 0 or not math.isfinite(seconds)):
            raise ValueError(f"seconds {seconds!r} is not a positive time")
        case = d.get("case")
        if case not in {c for cases in CASES.values() for c in cases}:
            raise ValueError(f"case {case!r} is not one of {sorted({c for v in CASES.values() for c in v})}")
        return cls(case, method, None if seconds is None else float(seconds), _count(d, "nbytes"),
                   str(d.get("why", "")))


@dataclass(frozen=True)
class Choice:
    """The snapshot's method and the restore's (their chunk sizes are equal: see the module's docstring)."""

    snapshot: Method
    restore: Method

    def as_dict(self) -> dict[str, Any]:
        return {"snapshot": asdict(self.snapshot), "restore": asdict(self.restore)}


def default_choice(threads: int, kernel: str) -> Choice:
    """hpcft's method without calibration: `kernel` (the cheapest that runs here: ntcopy.kernels()), `threads`,
    1 MiB chunks."""
    m = Method(_kernel(kernel), max(1, threads), DEFAULT_CHUNK)
    return Choice(m, m)


def _cost(method: Method) -> tuple:
    """The order among ties: fewer threads, the kernel in `KERNELS` order, the chunk nearest the default."""
    return (method.threads, KERNELS.index(method.kernel), abs(math.log2(method.chunk_bytes / DEFAULT_CHUNK)))


def _within(times: dict[Method, float], margin: float) -> Method:
    """The cheapest (`_cost`) method whose time is within `margin` of the fastest."""
    best = min(times.values())
    return min((m for m, t in times.items() if t <= best * (1 + margin)), key=_cost)


def _times(samples: Iterable[Sample], cases: Sequence[str]) -> dict[Method, float]:
    """Per method measured in every one of `cases` (and that ran), the sum of its times over them."""
    by: dict[Method, dict[str, float]] = {}
    for s in samples:
        if s.case in cases and s.seconds is not None:
            by.setdefault(s.method, {})[s.case] = s.seconds / s.nbytes  # per byte: sizes may differ between cases
    return {m: sum(t.values()) for m, t in by.items() if len(t) == len(cases)}


def best_per_chunk(samples: Sequence[Sample], direction: str,
                   margin: float = MARGIN) -> dict[int, tuple[Method, float]]:
    """For each chunk size measured in all of `direction`'s cases: the method `pick` would take at that size, and its
    time per byte."""
    times = _times(samples, CASES[direction])
    out = {}
    for c in sorted({m.chunk_bytes for m in times}):
        m = _within({m: t for m, t in times.items() if m.chunk_bytes == c}, margin)
        out[c] = (m, times[m])
    return out


def pick(samples: Sequence[Sample], fallback: Choice, margin: float = MARGIN) -> Choice:
    """The choice the measurements support: the chunk size whose best snapshot + best restore is fastest (ties: the
    size nearest the default), then each direction's fastest method at that size (ties: `_cost`). `fallback` where
    no chunk size was measured usably in both directions."""
    snap, rest = best_per_chunk(samples, "snapshot", margin), best_per_chunk(samples, "restore", margin)
    totals = {c: snap[c][1] + rest[c][1] for c in set(snap) & set(rest)}
    if not totals:
        return fallback
    best = min(totals.values())
    chunk = min((c for c, t in totals.items() if t <= best * (1 + margin)),
                key=lambda c: abs(math.log2(c / DEFAULT_CHUNK)))
    return Choice(snap[chunk][0], rest[chunk][0])


# ---------------------------------------------------------------- the HPCFT_COPY override

def parse_override(text: str, base: Choice) -> Choice:
    """`base` with what `text` pins: comma-separated `fused` / `stream` / `memcpy` (the kernel), `kernel=`, `threads=`,
    `chunk=` (both directions), or `snapshot.<field>=` / `restore.<field>=` (one; never `chunk`: one size for both).
    ConfigError naming the part it cannot use."""
    fields: dict[str, dict[str, Any]] = {"snapshot": {}, "restore": {}}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep:
            key, value = "kernel", part
        where, dot, name = key.strip().rpartition(".")
        targets = [where] if dot else ["snapshot", "restore"]
        if dot and where not in fields or name not in ("kernel", "threads", "chunk"):
            raise ConfigError(f"HPCFT_COPY: {part!r} is not a setting; {OVERRIDE_HELP}")
        if name == "chunk" and dot:
            raise ConfigError(f"HPCFT_COPY: {part!r}: the chunk size is one for both directions (the restore reads "
                              f"the grid the snapshot wrote); write chunk={value.strip()}")
        parsed = _override_value(name, value.strip(), part)
        for t in targets:
            fields[t][name] = parsed
    chunk = fields["snapshot"].pop("chunk", base.snapshot.chunk_bytes)
    fields["restore"].pop("chunk", None)
    return Choice(*(Method(f.get("kernel", m.kernel), f.get("threads", m.threads), chunk)
                    for m, f in ((base.snapshot, fields["snapshot"]), (base.restore, fields["restore"]))))


def _override_value(name: str, value: str, part: str) -> Any:
    try:
        if name == "kernel":
            return _kernel(value)
        if name == "threads":
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"threads {value!r} is not a whole number of at least 1")
            return int(value)
        n = _size(value)
        if not CHUNK_RANGE[0] <= n <= CHUNK_RANGE[1]:
            raise ValueError(f"chunk must be between {_size_text(CHUNK_RANGE[0])} and {_size_text(CHUNK_RANGE[1])}")
        return n
    except ValueError as exc:
        raise ConfigError(f"HPCFT_COPY: {part!r}: {exc}; {OVERRIDE_HELP}") from None


def _kernel(value: Any) -> str:
    if value not in KERNELS:
        raise ValueError(f"kernel {value!r} is not one of {', '.join(KERNELS)}")
    return value


def _count(d: dict[str, Any], key: str) -> int:
    value = d.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} {value!r} is not a positive count")
    return value


_UNITS = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20}


def _size(text: str) -> int:
    """Bytes from '1048576', '256K', '1M' or '4MiB'."""
    digits = text.rstrip("kKmMiIbB")
    unit = text[len(digits):].lower()
    if not digits.isdigit() or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size (bytes, or a number with K or M)")
    return int(digits) * _UNITS[unit]


def _size_text(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and not n % (1 << 20) else f"{n >> 10} KiB"
