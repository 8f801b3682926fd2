"""The state's entries, collected once per layout: `state.collect` costs tens of microseconds a tensor, too slow for
the training thread at every snapshot. `StateView` remembers where each tensor lives (owner dict, key, object, data
pointer, sizes, strides, dtype) and at each snapshot only checks those; anything moved, reshaped, added or removed
makes it collect anew, and so does every call where state_dict names do not map to module attributes (hooks)."""
from __future__ import annotations

import operator
from typing import Any

import torch

from hpcft.snapshot import state
from hpcft.snapshot.state import Entry


def _storage_of(t: Any) -> torch.Tensor:
    """The tensor whose data pointer an entry views: a DTensor's local shard, else the tensor itself."""
    local = getattr(t, "_local_tensor", None)
    return t if local is None else local


_DTYPE = operator.attrgetter("dtype")


def _geometry(tensors: list[torch.Tensor]) -> tuple[list, ...]:
    """Where and how each tensor's bytes lie: data pointer, sizes, strides, dtype (C-level maps, ~0.2 µs each). An
    in-place change that keeps the pointer (`resize_` to fewer elements, `t_()`, `set_`) changes one of the others."""
    return (list(map(torch.Tensor.data_ptr, tensors)), list(map(torch.Tensor.size, tensors)),
            list(map(torch.Tensor.stride, tensors)), list(map(_DTYPE, tensors)))


class _Probes:
    """Where each tensor lives (owner dict, key), the object there, its viewed storage and geometry; `moved()` compares
    them all with C-level iteration (map, operator.is_): under a microsecond per tensor, a Python loop took several."""

    def __init__(self, found: list[tuple[dict, str, Any]]):
        self.owners = [o for o, _, _ in found]
        self.keys = [k for _, k, _ in found]
        self.objs = [t for _, _, t in found]
        self.storages = [_storage_of(t) for t in self.objs]
        self.geometry = _geometry(self.storages)
        # a DTensor whose local shard was swapped keeps its object: its shard is checked too
        self.shards = [(t, local) for t, local in zip(self.objs, self.storages) if t is not local]

    def moved(self) -> bool:
        return (not all(map(operator.is_, map(dict.get, self.owners, self.keys), self.objs))
                or any(t._local_tensor is not local for t, local in self.shards)
                or _geometry(self.storages) != self.geometry)


class StateView:
    """`entries()`: the same list object for as long as the live tensors are the ones it was collected from."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 dp_ranks: frozenset[int] | None):
        self.model, self.optimizer, self.dp_ranks = model, optimizer, dp_ranks
        self.names: dict[int, str] = {}
        self.optim_shape = state.optimizer_shape(None, {})  # the optimizer's shape as of the last collect
        self._entries: list[Entry] | None = None
        self._probes = _Probes([])
        self._params: list[int] = []
        self._opt_state: Any = None  # the optimizer's state dict, its per-parameter dicts and their sizes
        self._state_dicts: list[dict] = []
        self._state_sizes: list[int] = []
        self._cacheable = True
        self.collections = 0  # how often the state was collected (tests, benches)

    def entries(self) -> list[Entry]:
        if self._entries is None or not self._cacheable or self._moved():
            self._collect()
        return self._entries

    def _opt_params(self) -> list[Any]:
        return [p for g in self.optimizer.param_groups for p in g["params"]] if self.optimizer is not None else []

    def _moved(self) -> bool:
        if self._probes.moved() or list(map(id, self._opt_params())) != self._params:
            return True
        # by iteration, not by lookup: a lookup hashes a parameter through Tensor.__hash__, a Python call
        opt_state = self.optimizer.state if self.optimizer is not None else None
        if opt_state is not self._opt_state or (opt_state is not None and len(opt_state) != len(self._state_dicts)):
            return True
        return opt_state is not None and (not all(map(operator.is_, opt_state.values(), self._state_dicts))
                                          or list(map(len, self._state_dicts)) != self._state_sizes)

    def _collect(self) -> None:
        self.collections += 1
        self.names = state.param_names(self.model)
        self._entries = state.collect(self.model, self.optimizer, self.dp_ranks)
        owners = {f"{prefix}.{k}" if prefix else k: d for prefix, m in self.model.named_modules(remove_duplicate=False)
                  for d in (m._parameters, m._buffers) for k in d}
        probes: list[tuple[dict, str, Any]] = []
        self._cacheable = True
        for name, t in self.model.state_dict(keep_vars=True).items():
            if not isinstance(t, torch.Tensor):
                continue
            owner = owners.get(name)
            key = name.rsplit(".", 1)[-1]
            if owner is None or owner.get(key) is not t:
                self._cacheable = False  # renamed or made by a hook: nothing stable to check against
                break
            probes.append((owner, key, t))
        params = self._opt_params()
        opt_state = self.optimizer.state if self.optimizer is not None else {}
        for p in params:
            st = opt_state.get(p, {})
            probes.extend((st, k, v) for k, v in st.items() if isinstance(v, torch.Tensor))
        self._probes = _Probes(probes)
        self._params = [id(p) for p in params]
        self._opt_state = self.optimizer.state if self.optimizer is not None else None
        self._state_dicts = list(opt_state.values())
        self._state_sizes = [len(d) for d in self._state_dicts]
        self.optim_shape = state.optimizer_shape(self.optimizer, self.names)
