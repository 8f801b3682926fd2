"""The process groups hpcft's own collectives travel on. hpcft's metadata (steps held, verdicts, signatures) is CPU
tensors, which NCCL/RCCL groups refuse; so every group hpcft is given is paired with one that carries them: itself
where it does (gloo, `cpu:gloo,cuda:nccl`), else a gloo group of the same ranks, made once, collectively. Bulk bytes
travel on the user's group where it carries their device (RCCL over the fabric beats gloo over TCP)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hpcft.errors import ConfigError

# CPU groups made so far, by the group they stand for: a second Checkpointer (or a restore after the first
# one) reuses them. Every rank makes the same calls in the same order, so the caches agree.
_made: dict[Any, Any] = {}


def carries(pg: Any, device: torch.device | str) -> bool:
    """Whether collectives on `pg` accept tensors on `device` ('cpu:gloo,cuda:nccl' carries both)."""
    kind = torch.device(device).type
    try:
        config = dist.get_backend_config(pg)
    except (RuntimeError, ValueError, AttributeError):
        return False
    return any(part.split(":")[0].strip() == kind for part in config.split(",") if ":" in part)


@dataclass(frozen=True)
class Group:
    """The data-parallel group: `pg` carries hpcft's CPU tensors, `user_pg` is the script's (for bytes on its
    device), `ranks` and my index `member` among them."""
    pg: Any
    ranks: tuple[int, ...]
    member: int
    user_pg: Any = None

    @property
    def size(self) -> int:
        return len(self.ranks)

    def for_bytes(self, device: torch.device) -> tuple[Any, torch.device]:
        """(group, staging device) for bytes on `device`: the user's group where it carries it, else the CPU one."""
        if self.user_pg is not None and carries(self.user_pg, device):
            return self.user_pg, torch.device(device)
        return self.pg, torch.device("cpu")

    @staticmethod
    def of(pg: Any, cpu_pg: Any = None) -> "Group | None":
        """`pg` (a process group or a 1-D DeviceMesh) as a Group whose collectives run on `cpu_pg` (default: `pg`)."""
        if pg is None or not dist.is_initialized():
            return None
        if hasattr(pg, "get_group"):  # a 1-D DeviceMesh such as ctx.mesh["dp"]
            pg = pg.get_group()
        ranks = tuple(dist.get_process_group_ranks(pg))
        return Group(pg if cpu_pg is None else cpu_pg, ranks, ranks.index(dist.get_rank()), user_pg=pg)


@dataclass(frozen=True)
class Comm:
    """Where hpcft's collectives go: `world` (None: the default group, or not distributed) and `dp`."""
    world: Any = None
    dp: Group | None = None


def forget() -> None:
    """Drop the CPU groups made so far (their process groups were destroyed: an in-process restart makes new ones)."""
    _made.clear()


def world_cpu_group() -> Any:
    """A group of every rank that carries CPU tensors: None (the default group) where it does, else a gloo group made
    once (collective)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    default = dist.group.WORLD
    if carries(default, "cpu"):
        return None
    if default not in _made:
        _made[default] = dist.new_group(backend="gloo")
    return _made[default]


def comm(dp_group: Any = None) -> Comm:
    """The groups of a Checkpointer (collective on every rank of the job, which must all pass their own data-parallel
    group or all pass None): the world's CPU group and the data-parallel group paired with a CPU one."""
    if not dist.is_initialized():
        return Comm()
    world = world_cpu_group()
    if hasattr(dp_group, "get_group"):
        dp_group = dp_group.get_group()
    if dist.get_world_size() == 1:
        return Comm(world, Group.of(dp_group))
    return Comm(world, Group.of(dp_group, _dp_cpu_group(dp_group, world)))


def _dp_cpu_group(dp_group: Any, world: Any) -> Any:
    """The CPU group standing for this rank's data-parallel group. If any rank's group refuses CPU tensors, every
    rank learns every group's members (by one all-gather of [first rank, size, needs one]) and all create the
    missing ones in the same order, as torch requires of new_group."""
    ranks = sorted(dist.get_process_group_ranks(dp_group)) if dp_group is not None else []
    need = int(bool(ranks) and not carries(dp_group, "cpu"))
    mine = torch.tensor([ranks[0] if ranks else -1, len(ranks), need], dtype=torch.int64)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine, group=world)
    members: dict[int, list[int]] = {}
    needs: dict[int, bool] = {}
    for rank, (first, _, wants) in enumerate(r.tolist() for r in rows):
        if first >= 0:
            members.setdefault(first, []).append(rank)
            needs[first] = needs.get(first, False) or bool(wants)
    consistent = not ranks or members.get(ranks[0]) == ranks
    verdict = torch.tensor([int(not consistent)], dtype=torch.int64)
    dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=world)
    if int(verdict):
        raise ConfigError("the data-parallel groups passed to hpcft.Checkpointer do not partition the ranks (each rank "
                          "must pass the one group it is a member of, e.g. ctx.dp_group or mesh['dp'])")
    if not any(needs.values()):
        return None
    everyone = list(range(dist.get_world_size()))
    made = None
    for first in sorted(members):
        if not needs[first]:
            continue
        key = (dist.group.WORLD, tuple(members[first]))
        if key not in _made:
            _made[key] = world if members[first] == everyone and world is not None else \
                dist.new_group(members[first], backend="gloo")
        if first == (ranks[0] if ranks else None):
            made = _made[key]
    return made
