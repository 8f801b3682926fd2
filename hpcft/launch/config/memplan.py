"""Memory planning: do (keep + 1) snapshot slots, the agents' spare slot and the parity or partner copies fit a
node's memory with headroom? Pure arithmetic (`plan`, `verdict`) over figures read elsewhere (hpcft.nodemem, the
agents' status); what to change is said in numbers when they do not fit."""
from __future__ import annotations

import re
from dataclasses import dataclass

# protection records an agent holds at the peak of a pass: the two it keeps (protect.retire) and the one being written
PROTECT_RECORDS = 3
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", re.IGNORECASE)


def parse_bytes(value: object) -> int:
    """Bytes from an int or a string such as '4096', '64G', '1.5TiB', '512 MB' (binary units)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = _SIZE.fullmatch(str(value))
    if not m:
        raise ValueError(f"{value!r} is not a size (bytes, or a number with K, M, G or T)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def human(n: float) -> str:
    """Bytes in the largest binary unit that keeps the figure at 1 or more (KiB at least)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n / 2**10:.1f} KiB"


@dataclass(frozen=True)
class Plan:
    """One node's memory for snapshots: `slots` versions of `state` bytes, and the agents' records of
    `ratio` × state each (partner 1, xor 1/(G−1), rs k/(G−k))."""
    state: int
    keep: int
    slots: int
    ratio: float
    scheme: str

    @property
    def snapshots(self) -> int:
        return self.slots * self.state

    @property
    def protection(self) -> int:
        return int(PROTECT_RECORDS * self.ratio * self.state)

    @property
    def needed(self) -> int:
        return self.snapshots + self.protection

    def line(self) -> str:
        return (f"{human(self.needed)} per node = {self.slots} snapshot slots (keep {self.keep} + 1"
                f"{' + 1 pinned by the agent' if self.slots > self.keep + 1 else ''}) × {human(self.state)}"
                + (f" + {PROTECT_RECORDS} {self.scheme} records × {self.ratio:.2f} × {human(self.state)}"
                   if self.ratio else ""))


def plan(state: int, keep: int, scheme: str = "none", ratio: float = 0.0) -> Plan:
    """The plan for `state` bytes per node; with agents (`scheme` not none) one more slot for their pin."""
    agents = scheme != "none"
    return Plan(state, keep, keep + 1 + (1 if agents else 0), ratio if agents else 0.0, scheme)


def verdict(p: Plan, capacity: int, headroom: float, where: str) -> str | None:
    """None when `p` fits `capacity` less the headroom, else what does not fit and what to change, in numbers."""
    usable = int(capacity * (1 - headroom))
    if p.needed <= usable:
        return None
    fixes = []
    fit_keep = int((usable - p.protection) // p.state) - (p.slots - p.keep)
    if 1 <= fit_keep < p.keep:
        fixes.append(f"keep={fit_keep} in the Checkpointer (and --keep {fit_keep})")
    if p.scheme == "partner":
        xor = plan(p.state, p.keep, "xor", 1 / 3)
        if xor.needed <= usable:
            fixes.append(f"--protect xor --group 4 ({human(xor.needed)}: parity is 1/3 of a partner copy)")
    fit_state = usable / (p.slots + PROTECT_RECORDS * p.ratio)
    fixes.append(f"less state per node: at most {human(fit_state)} per snapshot fits (more nodes, or shard further)")
    if headroom:
        fixes.append(f"a smaller --memory-headroom (now {headroom:g})")
    return (f"snapshots need {p.line()}, but {where} offers {human(capacity)}, {human(usable)} after the "
            f"{headroom:.0%} headroom; change one of: " + "; ".join(fixes))
