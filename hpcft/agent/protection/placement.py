"""Where protection data goes (pure): sets of G node slots, which member holds which parity stripe, the partner of
each slot. On slot positions, so a spare that takes a failed node's slot takes its role too."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hpcft.errors import ConfigError

SCHEMES = ("none", "partner", "xor", "rs")


@dataclass(frozen=True)
class Scheme:
    """The protection configuration: `name`, set size `group` and tolerated `losses` per set (xor: 1), partner
    `distance`."""
    name: str = "xor"
    group: int = 4
    losses: int = 1
    distance: int = 1

    def __post_init__(self) -> None:
        if self.name not in SCHEMES:
            raise ConfigError(f"unknown protection scheme {self.name!r}; choose one of {', '.join(SCHEMES)}")
        if self.name == "xor" and self.losses != 1:
            raise ConfigError(f"xor tolerates exactly one loss per set (got losses={self.losses}); use rs for more")
        if self.name in ("xor", "rs") and not 1 <= self.losses < self.group:
            raise ConfigError(f"{self.name} needs 1 <= losses < group (got losses={self.losses}, group={self.group})")
        if self.name == "partner" and self.distance < 1:
            raise ConfigError(f"partner distance must be at least 1 (got {self.distance})")

    @property
    def tolerated(self) -> int:
        """Node losses per set this scheme survives."""
        return {"none": 0, "partner": 1}.get(self.name, self.losses)

    def stored_over_state(self, set_size: int | None = None) -> float:
        """Extra memory per node ÷ the node's own snapshot size (partner 1, xor 1/(G−1), rs k/(G−k))."""
        g = set_size or self.group
        return {"none": 0.0, "partner": 1.0}.get(self.name, self.losses / max(1, g - self.losses))


@dataclass(frozen=True)
class ProtectionSet:
    """One set of slot indices: stripe s has parity on members[(s+t) % G] for t < k and data from the others; each
    member holds parity for k stripes and gives one piece to each of G−k."""
    index: int
    members: tuple[int, ...]
    losses: int

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def data_pieces(self) -> int:
        """Pieces each member's payload is cut into (G − k)."""
        return self.size - self.losses

    def parity_positions(self, stripe: int) -> tuple[int, ...]:
        """Positions (indices into `members`) holding stripe `stripe`'s parity blocks, in block order."""
        return tuple((stripe + t) % self.size for t in range(self.losses))

    def data_positions(self, stripe: int) -> tuple[int, ...]:
        """Positions giving a data piece to stripe `stripe`, in block order."""
        parity = set(self.parity_positions(stripe))
        return tuple(p for p in range(self.size) if p not in parity)

    def piece_of(self, position: int, stripe: int) -> int:
        """Which of member `position`'s pieces feeds stripe `stripe` (it must be a data member there)."""
        mine = [s for s in range(self.size) if position in self.data_positions(s)]
        return mine.index(stripe)

    def stripes_holding(self, position: int) -> tuple[int, ...]:
        """Stripes whose parity member `position` holds, and which block (t) of each."""
        return tuple(s for s in range(self.size) if position in self.parity_positions(s))


@dataclass(frozen=True)
class Placement:
    """The whole job's protection layout over `slots` ordered slot positions."""
    scheme: Scheme
    slots: int
    sets: tuple[ProtectionSet, ...]

    def set_of(self, slot: int) -> ProtectionSet:
        """The set that slot `slot` belongs to."""
        for s in self.sets:
            if slot in s.members:
                return s
        raise ConfigError(f"slot {slot} is in no protection set (placement covers {self.slots} slots)")

    def partner_of(self, slot: int) -> int:
        """The slot holding a full copy of `slot`'s snapshot (partner scheme)."""
        return (slot + self.scheme.distance) % self.slots

    def partnered_by(self, slot: int) -> int:
        """The slot whose snapshot `slot` holds a copy of (partner scheme)."""
        return (slot - self.scheme.distance) % self.slots

    def exchange_peers(self, slot: int) -> frozenset[int]:
        """The slots `slot` exchanges bulk data with in a pass or a rebuild (a symmetric relation): its set's other
        members (xor/rs), its partner and the slot it partners (partner), none (none)."""
        if self.scheme.name == "none":
            return frozenset()
        if self.scheme.name == "partner":
            return frozenset({self.partner_of(slot), self.partnered_by(slot)}) - {slot}
        return frozenset(self.set_of(slot).members) - {slot}


def spread(nodes: Sequence[str], domains: Mapping[str, str] | None = None) -> list[str]:
    """Nodes ordered so that consecutive ones come from different failure domains where possible: round-robin over
    the domains, each one's nodes in given order."""
    if len(set(nodes)) != len(nodes):
        dup = sorted({n for n in nodes if list(nodes).count(n) > 1})
        raise ConfigError(f"node list names {', '.join(dup)} more than once; a set must never hold two "
                          "members on one node")
    if not domains:
        return list(nodes)
    by_domain: dict[str, list[str]] = {}
    for n in nodes:
        by_domain.setdefault(domains.get(n, n), []).append(n)
    queues = sorted(by_domain.values(), key=len, reverse=True)
    out: list[str] = []
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop(0))
    return out


def plan(slots: int, scheme: Scheme) -> Placement:
    """`slots` positions cut into consecutive sets of at least `scheme.group`, sizes differing by one at most (partner
    and none: one set of everything)."""
    if slots < 1:
        raise ConfigError("protection needs at least one node")
    if scheme.name in ("none", "partner"):
        if scheme.name == "partner" and (slots < 2 or scheme.distance % slots == 0):
            raise ConfigError(f"partner at distance {scheme.distance} needs a different node among {slots}: "
                              "use at least 2 nodes and a distance that is not a multiple of the node count")
        return Placement(scheme, slots, (ProtectionSet(0, tuple(range(slots)), scheme.tolerated),))
    if slots < scheme.group:
        raise ConfigError(f"{scheme.name} with group {scheme.group} needs at least {scheme.group} nodes "
                          f"(got {slots}); lower the group size or add nodes")
    count = slots // scheme.group
    base, extra = divmod(slots, count)
    sets, start = [], 0
    for i in range(count):
        size = base + (1 if i < extra else 0)
        sets.append(ProtectionSet(i, tuple(range(start, start + size)), scheme.losses))
        start += size
    return Placement(scheme, slots, tuple(sets))
