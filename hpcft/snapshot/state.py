"""What a snapshot holds: the model's and optimizer's tensors (local shards for DTensors), by name. Every entry is a
live tensor the optimizer updates in place, so a restore copies bytes back into exactly these tensors."""
import functools
import logging
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from hpcft.errors import CheckpointError, ConfigError, ManifestError
from hpcft.snapshot import plan

_log = logging.getLogger(__name__)


@dataclass
class Entry:
    """One named tensor of the state: `local` is the bytes this rank holds (the shard of a DTensor)."""
    name: str
    local: torch.Tensor
    replicated: bool  # identical on every member of the data-parallel group
    placement: dict[str, Any] | None = None
    # changed outside the optimizer's step (a buffer: BatchNorm's statistics change in the forward pass), so the next
    # step's guard does not keep it still while the copy reads it: a snapshot copies it at the boundary
    boundary: bool = False

    @functools.cached_property
    def nbytes(self) -> int:  # read per entry by every plan and check: computed once (`local`'s size is fixed)
        return self.local.numel() * self.local.element_size()

    def key(self) -> tuple[str, str, list[int], dict[str, Any] | None]:
        """(name, dtype, shape, placement): what a snapshot's entry must say to be restored into this one."""
        return self.name, str(self.local.dtype).removeprefix("torch."), list(self.local.shape), self.placement or None

    def describe(self) -> dict[str, Any]:
        name, dtype, shape, placement = self.key()
        d = {"name": name, "dtype": dtype, "shape": shape, "nbytes": self.nbytes, "replicated": self.replicated}
        if placement:
            d["placement"] = placement
        return d


def grains(entries: Sequence[Entry]) -> list[int]:
    """Element sizes of `entries`: where a data-parallel share may be cut (see plan.rep_cuts)."""
    return [e.local.element_size() for e in entries]


def split(entries: Sequence[Entry], group: Any) -> tuple[list[Entry], list[Entry]]:
    """(own, replicated): the replicated entries are shared out only over a data-parallel group of several ranks."""
    on = group is not None and group.size > 1
    return [e for e in entries if not (on and e.replicated)], [e for e in entries if on and e.replicated]


def lay_out(own: Sequence[Entry], rep: Sequence[Entry], group: Any) -> plan.Layout:
    """This member's data file: the own entries whole, then its share of the replicated ones."""
    member, members = (group.member, group.size) if rep else (0, 1)
    return plan.layout([e.nbytes for e in own], [e.nbytes for e in rep], member, members, grains(rep))


try:
    from torch.distributed.tensor import DTensor as _DTENSOR
except ImportError:
    _DTENSOR = None


def _is_dtensor(t: Any) -> bool:
    return _DTENSOR is not None and isinstance(t, _DTENSOR)


def _placement(t: Any) -> dict[str, Any]:
    """How a DTensor's local shard sits in the global tensor: what the durable tier's DCP chunks need
    (`global_offset`: the shard's first index in every dimension)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = t.device_mesh
    _, offset = compute_local_shape_and_global_offset(t.shape, mesh, t.placements)
    return {"placements": [str(p) for p in t.placements], "mesh_shape": list(mesh.mesh.shape),
            "mesh_dims": list(mesh.mesh_dim_names or ()), "global_shape": list(t.shape),
            "global_offset": [int(x) for x in offset]}


def _replicated(t: Any, dp_ranks: frozenset[int] | None) -> bool:
    """Is `t` identical across the data-parallel group? Plain tensors are (DDP); a DTensor is when Replicate on the
    mesh dimension spanning the group, or when its mesh does not span the group (tensor parallel in each replica)."""
    if not dp_ranks or len(dp_ranks) < 2:
        return False
    if not _is_dtensor(t):
        return True
    mesh = t.device_mesh
    for dim in range(mesh.ndim):
        if frozenset(dist.get_process_group_ranks(mesh.get_group(dim))) == dp_ranks:
            return t.placements[dim].is_replicate()
    return not (frozenset(mesh.mesh.flatten().tolist()) & dp_ranks) - {dist.get_rank()}


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if _is_dtensor(t) else t).detach()


def param_names(model: torch.nn.Module) -> dict[int, str]:
    """id(parameter) -> its name in the model."""
    return {id(p): n for n, p in model.named_parameters()}


def collect(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
            dp_ranks: frozenset[int] | None) -> list[Entry]:
    """Model state_dict entries (`model/<name>`) then optimizer state tensors (`optim/<param>/<key>`). Only parameters
    and their optimizer state count as replicated; buffers (not kept in sync by FSDP) are saved by their owner."""
    params = dict(model.named_parameters())
    rep_param = {id(p): _replicated(p, dp_ranks) for p in params.values()}
    out = []
    for name, t in model.state_dict().items():
        if isinstance(t, torch.Tensor):
            rep = name in params and rep_param[id(params[name])] and _replicated(t, dp_ranks)
            out.append(Entry(f"model/{name}", _local(t), rep, _placement(t) if _is_dtensor(t) else None,
                             boundary=name not in params))
    if optimizer is not None:
        names = {id(p): n for n, p in params.items()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p)
                if not state:
                    continue
                if id(p) not in names:
                    raise ConfigError("the optimizer holds a parameter that is not in the model; "
                                      "give the Checkpointer the model that owns every optimized parameter")
                for key, v in state.items():
                    if isinstance(v, torch.Tensor):
                        rep = rep_param[id(p)] and _replicated(v, dp_ranks)
                        out.append(Entry(f"optim/{names[id(p)]}/{key}", _local(v), rep,
                                         _placement(v) if _is_dtensor(v) else None))
    return out


def _jsonable(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return {"tensor": v.item() if v.numel() == 1 else v.tolist()}
    if isinstance(v, tuple):
        return {"tuple": [_jsonable(x) for x in v]}
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, list):
        return [_jsonable(x) for x in v]
    raise CheckpointError(f"cannot record optimizer setting of type {type(v).__name__} in a JSON manifest")


def unjson(v: Any, like: Any = None) -> Any:
    """A value `optimizer_meta` recorded, as Python (tuples and tensors back; a tensor into `like` if it is one)."""
    if isinstance(v, dict) and "tuple" in v:
        return tuple(unjson(x) for x in v["tuple"])
    if isinstance(v, dict) and "tensor" in v:
        if isinstance(like, torch.Tensor):
            like.copy_(torch.as_tensor(v["tensor"], dtype=like.dtype))
            return like
        return torch.tensor(v["tensor"])
    return v


@dataclass(frozen=True)
class OptimizerShape:
    """What `optimizer_meta` reads, found once per layout: each param group's parameter names (DCP's `params`) and
    where non-tensor per-parameter state lives."""
    group_params: list[list[str]]
    scalars: list[tuple[str, dict, str]]  # ("<param name>/<key>", the parameter's state dict, key)


def optimizer_shape(optimizer: torch.optim.Optimizer | None, names: dict[int, str]) -> OptimizerShape:
    """The optimizer's `OptimizerShape`; `names` is the model's `param_names`."""
    if optimizer is None:
        return OptimizerShape([], [])
    scalars = [(f"{names[id(p)]}/{key}", st, key) for p, st in optimizer.state.items() if id(p) in names
               for key, v in st.items() if not isinstance(v, torch.Tensor)]
    return OptimizerShape([[names.get(id(p), "") for p in g["params"]] for g in optimizer.param_groups], scalars)


def optimizer_meta(optimizer: torch.optim.Optimizer | None, shape: OptimizerShape) -> dict[str, Any]:
    """Each param group's hyperparameters (read now: a scheduler changes them) and non-tensor state, as JSON."""
    if optimizer is None:
        return {}
    groups = [{k: _jsonable(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    scalars = {label: _jsonable(st[key]) for label, st, key in shape.scalars if key in st}
    return {"param_groups": groups, "scalars": scalars, "group_params": shape.group_params}


def _kind(v: Any) -> Any:
    """What a hyperparameter is (saved as JSON or live), as far as a saved value must agree with the live one:
    a tuple is the kinds of its items (Adam's betas must stay two numbers)."""
    if isinstance(v, dict) and isinstance(v.get("tuple"), list):
        v = tuple(v["tuple"])
    if isinstance(v, tuple):
        return tuple(_kind(x) for x in v)
    if isinstance(v, dict):
        return "number" if isinstance(v.get("tensor"), (int, float)) and not isinstance(v["tensor"], bool) \
            else "object"
    if isinstance(v, torch.Tensor) and v.numel() == 1 or isinstance(v, (int, float)) and not isinstance(v, bool):
        return "number"
    return {bool: "bool", str: "str", type(None): "none", list: "list"}.get(type(v), "other")


def check_optimizer_meta(optimizer: torch.optim.Optimizer | None, meta: Any) -> None:
    """Before a restore loads anything: `meta` (a manifest's `optim`) fits the live optimizer: as many param groups
    (else CheckpointError), values of the live kind and scalars as an object (else ManifestError: the manifest lies)."""
    if optimizer is None or not meta:
        return
    groups, scalars = meta.get("param_groups"), meta.get("scalars")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups) or not isinstance(scalars, dict):
        raise ManifestError("the manifest's optimizer settings are not a list of param groups and a scalars object")
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(f"the snapshot has {len(groups)} optimizer param groups, the live optimizer "
                              f"{len(optimizer.param_groups)}; restore into the same optimizer")
    for i, (group, saved) in enumerate(zip(optimizer.param_groups, groups)):
        for k, v in saved.items():
            live = group.get(k)
            if k == "params" or (k in group and live is not None and v is not None and _kind(v) != _kind(live)):
                raise ManifestError(f"the manifest's optimizer param group {i} sets {k} to {v!r}, "
                                    f"live {type(live).__name__}")


def apply_optimizer_meta(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                         meta: dict[str, Any]) -> None:
    """Put saved hyperparameters and non-tensor state back (`meta` passed `check_optimizer_meta` with the load)."""
    if optimizer is None or not meta:
        return
    for group, saved in zip(optimizer.param_groups, meta["param_groups"]):
        for k, v in saved.items():
            group[k] = unjson(v, group.get(k))
    if not meta.get("scalars"):  # the usual case (torch keeps step counters as tensors): no walk of the state
        return
    names = param_names(model)
    for p, state in optimizer.state.items():
        for key in list(state):
            k = f"{names.get(id(p))}/{key}"
            if k in meta["scalars"]:
                state[key] = unjson(meta["scalars"][k])


def ensure_optimizer_state(optimizer: torch.optim.Optimizer | None) -> None:
    """Create the optimizer's lazily built state (moments, step counters) for a restore to copy into, without
    changing any parameter (torch's helper: a step with lr=0 and zero gradients)."""
    if optimizer is None:
        return
    held = {id(p) for p, st in optimizer.state.items() if st}  # by id: hashing a tensor is a Python call
    if all(id(p) in held for g in optimizer.param_groups for p in g["params"] if p.requires_grad):
        return
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    # torch's helper does nothing once any gradient exists (a warm-up pass before restore): set them aside meanwhile
    kept = {p: p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None}
    for p in kept:
        p.grad = None
    try:
        _init_optim_state(optimizer)
    finally:
        for p, grad in kept.items():
            p.grad = grad
