"""Ordered node slots: N active slots hold the trainers, S spares wait; a spare takes a failed node's slot,
so every rank keeps its role (slot i always runs ranks i*T .. i*T+T-1). A node once bad stays excluded."""
from dataclasses import dataclass, replace

from hpcft.errors import ConfigError
from hpcft.slurm.nodelist import compress
from hpcft.store.paths import slot_ranks


def given_back(excluded: list[str] | tuple[str, ...], allocation: list[str] | tuple[str, ...],
               successor: bool) -> list[str]:
    """The excluded nodes Slurm gave back: those a new allocation (a requeued job's) holds again, used as healthy
    nodes whose memory is empty. A successor runs in the allocation they were excluded from, where a lost node is
    still listed until Slurm marks it down (--no-kill): none is given back there."""
    return [] if successor else [n for n in excluded if n in allocation]


def run_shape(ran: int, nodes: int | None, spares: int, usable: int, successor: bool) -> tuple[int | None, int]:
    """(active nodes, spares) of a run in an allocation of `usable` nodes, the job asking for `nodes` active ones
    (None: the allocation less the spares) and `spares`, having run `ran` slots before (0: none, or a new job). A
    successor runs the slots as they were; a requeued run those, or the active nodes asked for where it has them
    (after an elastic shrink). Spares are those the allocation has beyond the active nodes: `hpcft submit` asks for
    a range (--nodes=N-(N+S)), which Slurm fills with the nodes in service."""
    active = ran if successor else max(ran, min(nodes or 0, usable)) if ran else nodes
    return (None, spares) if active is None else (active, max(0, min(spares, usable - active)))


class NoSpareError(ConfigError):
    """A slot lost its node and no spare is left to take it."""


@dataclass(frozen=True)
class Layout:
    """Which node runs which slot. Pure data: every change returns a new Layout."""

    slots: tuple[str, ...]
    spares: tuple[str, ...] = ()
    excluded: tuple[str, ...] = ()
    tasks_per_node: int = 1

    @classmethod
    def plan(cls, nodes: list[str], active: int | None = None, spares: int | None = None,
             tasks_per_node: int = 1, excluded: list[str] | tuple[str, ...] = (),
             previous: list[str] | tuple[str, ...] = ()) -> "Layout":
        """Split an allocation's `nodes` (in allocation order) into active slots and spares, skipping `excluded`; give
        `active` or `spares` or both. A node of `previous` (an earlier allocation's slots: a requeue) allocated again
        keeps its slot, since its memory still holds that slot's snapshots."""
        if tasks_per_node < 1:
            raise ConfigError(f"tasks per node must be at least 1 (got {tasks_per_node})")
        bad = set(excluded)
        usable = [n for n in dict.fromkeys(nodes) if n not in bad]
        if active is None:
            active = len(usable) - (spares or 0)
        if spares is None:
            spares = len(usable) - active
        if active < 1 or spares < 0:
            raise ConfigError(f"cannot run {active} active node(s) with {spares} spare(s): the allocation has "
                              f"{len(usable)} usable node(s) ({compress(usable) or 'none'}); "
                              "ask for more nodes (-N) or fewer spares (--spares)")
        if active + spares > len(usable):
            raise ConfigError(f"{active} active + {spares} spare node(s) need {active + spares} nodes, but the "
                              f"allocation has {len(usable)} usable ({compress(usable) or 'none'}"
                              f"{'; excluded: ' + compress(sorted(bad)) if bad else ''}); "
                              "ask for more nodes (-N) or fewer spares (--spares)")
        kept = [n if n in usable else None for n in previous] if len(previous) == active else [None] * active
        rest = [n for n in usable if n not in kept]
        slots = [node or rest.pop(0) for node in kept]
        return cls(slots=tuple(slots), spares=tuple(rest[:spares]),
                   excluded=tuple(dict.fromkeys(excluded)), tasks_per_node=tasks_per_node)

    @property
    def world_size(self) -> int:
        return len(self.slots) * self.tasks_per_node

    @property
    def master(self) -> str:
        """The rendezvous host: the node of slot 0."""
        return self.slots[0]

    def slot_of(self, node: str) -> int:
        """The slot index `node` runs; ConfigError if it runs none."""
        try:
            return self.slots.index(node)
        except ValueError:
            raise ConfigError(f"node {node} has no slot in this layout (slots: {', '.join(self.slots)})") from None

    def rank(self, node: str, local_rank: int) -> int:
        """The global rank of task `local_rank` on `node`: fixed by the slot, not by srun's node order."""
        if not 0 <= local_rank < self.tasks_per_node:
            raise ConfigError(f"local rank {local_rank} is outside 0..{self.tasks_per_node - 1}")
        return slot_ranks(self.slot_of(node), self.tasks_per_node)[local_rank]

    def replace(self, failed: list[str] | tuple[str, ...]) -> tuple["Layout", dict[str, str]]:
        """A spare takes each failed slot: (layout, {failed: spare}); NoSpareError when spares run out."""
        slots, spares = list(self.slots), [s for s in self.spares if s not in failed]
        moved: dict[str, str] = {}
        for node in failed:
            if node in slots:
                if not spares:
                    raise NoSpareError(f"node {node} failed and no spare node is left "
                                       f"(excluded: {', '.join(self.excluded + tuple(failed))})")
                spare = spares.pop(0)
                slots[slots.index(node)] = spare
                moved[node] = spare
        excluded = tuple(dict.fromkeys(self.excluded + tuple(failed)))
        return replace(self, slots=tuple(slots), spares=tuple(spares), excluded=excluded), moved

    def shrink(self, failed: list[str] | tuple[str, ...]) -> "Layout":
        """Exclude `failed`, dropping their slots: slot i is the i-th survivor (its ranks from i*T)."""
        gone = set(failed)
        return replace(self, slots=tuple(n for n in self.slots if n not in gone),
                       spares=tuple(s for s in self.spares if s not in gone),
                       excluded=tuple(dict.fromkeys(self.excluded + tuple(failed))))

    def grow(self, returned: list[str] | tuple[str, ...]) -> "Layout":
        """Take `returned` back as slots after the present ones, which keep their index (and ranks)."""
        back = [n for n in dict.fromkeys(returned) if n not in self.slots]
        return replace(self, slots=self.slots + tuple(back), spares=tuple(s for s in self.spares if s not in back),
                       excluded=tuple(n for n in self.excluded if n not in back))

    def to_env(self) -> dict[str, str]:
        """The variables a task needs to find its ranks (read back by `Layout.from_env`)."""
        return {"HPCFT_LAYOUT": ",".join(self.slots), "HPCFT_LAYOUT_TASKS": str(self.tasks_per_node)}

    @classmethod
    def from_env(cls, env: dict[str, str]) -> "Layout":
        """The layout exported by `hpcft run` (HPCFT_LAYOUT, HPCFT_LAYOUT_TASKS)."""
        text = env.get("HPCFT_LAYOUT")
        if not text:
            raise ConfigError("HPCFT_LAYOUT is not set: run tasks through `hpcft run`, which exports it")
        try:
            tasks = int(env.get("HPCFT_LAYOUT_TASKS", "1"))
        except ValueError:
            raise ConfigError(f"HPCFT_LAYOUT_TASKS={env.get('HPCFT_LAYOUT_TASKS')!r} is not an integer") from None
        return cls(slots=tuple(text.split(",")), tasks_per_node=tasks)
