"""What the snapshot and restore paths keep from one call to the next (the state view, the engine's layout, the
loader's sinks and checked grids, the store's parsed manifests) is dropped whenever it would be wrong: after each
change below, a snapshot taken on the same Checkpointer and a restore on the same Checkpointer (warm caches) bring
back the live state bit for bit, with its new shapes and dtypes."""
import json
import os
from pathlib import Path
from typing import Callable

import pytest
import torch

from hpcft.checkpointer import Checkpointer
from hpcft.options import Options


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 4)
        self.register_buffer("table", torch.arange(15, dtype=torch.float32).reshape(3, 5))
        self.register_buffer("scale", torch.linspace(0, 1, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum()


def _train(net: _Net, opt: torch.optim.Optimizer, it: int) -> None:
    net(torch.randn(3, 6, generator=torch.Generator().manual_seed(it))).backward()
    opt.step()
    opt.zero_grad()


def _model() -> tuple[_Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = _Net()
    return net, torch.optim.AdamW(net.parameters(), lr=0.1)


def _steps(ckpt: Checkpointer, net: _Net, opt: torch.optim.Optimizer, its: range) -> dict[str, torch.Tensor]:
    """Train iterations `its`, a snapshot after each; the live values once the last one is committed."""
    for it in its:
        _train(net, opt, it)
        ckpt.step(it)
        ckpt.wait()
    return _values(net, opt)


def _values(net: _Net, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"m.{k}": v.clone() for k, v in net.state_dict().items()}
    out.update({f"o.{i}.{k}": v.clone() for i, s in opt.state_dict()["state"].items() for k, v in s.items()
                if isinstance(v, torch.Tensor)})
    return out


def _perturb(net: _Net, opt: torch.optim.Optimizer) -> None:
    with torch.no_grad():
        for t in [*net.state_dict().values(), *(v for s in opt.state.values() for v in s.values())]:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                t.add_(1.0)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and
                                        torch.equal(a[k], b[k]) for k in a)


def _replace_param(net: _Net, opt: torch.optim.Optimizer) -> None:
    old = net.lin.bias
    new = torch.nn.Parameter(old.detach().clone() * 3)
    net.lin.bias = new
    group = opt.param_groups[0]
    group["params"] = [new if p is old else p for p in group["params"]]
    opt.state[new] = {k: v.clone() for k, v in opt.state.pop(old).items()}


def _resize_in_place(net: _Net, opt: torch.optim.Optimizer) -> None:
    net.scale.resize_(5)  # fewer elements: the same storage, the same data pointer


def _transpose_in_place(net: _Net, opt: torch.optim.Optimizer) -> None:
    net.table.t_()  # strided now, same pointer, new shape and strides


def _new_dtype(net: _Net, opt: torch.optim.Optimizer) -> None:
    net.scale.data = net.scale.data.double()


def _strided_param(net: _Net, opt: torch.optim.Optimizer) -> None:
    net.lin.weight.data = net.lin.weight.data.t().contiguous().t()  # same values and shape, column-major


CHANGES: dict[str, Callable[[_Net, torch.optim.Optimizer], None]] = {
    "parameter replaced": _replace_param, "resized in place": _resize_in_place,
    "transposed in place": _transpose_in_place, "dtype changed": _new_dtype, "strided parameter": _strided_param}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_changed_tensor_is_snapshotted_and_restored_bit_exact_on_warm_caches(shm_root: Path, change: str) -> None:
    net, opt = _model()
    with Checkpointer(net, opt, Options(root=shm_root, job_id="caches", keep=3, auto=False)) as ckpt:
        _steps(ckpt, net, opt, range(2))
        _perturb(net, opt)
        assert ckpt.restore() == 2  # every cache is warm from here
        collections = ckpt._view.collections
        CHANGES[change](net, opt)
        want = _steps(ckpt, net, opt, range(2, 4))
        assert ckpt._view.collections == collections + 1  # seen at the first snapshot after the change, once
        _perturb(net, opt)
        assert ckpt.restore() == 4
        assert _same(_values(net, opt), want)
        _perturb(net, opt)
        assert ckpt.restore() == 4  # and again, from the caches the last restore left
        assert _same(_values(net, opt), want)


def test_optimizer_state_appearing_after_the_first_snapshot(shm_root: Path) -> None:
    net, opt = _model()
    with Checkpointer(net, opt, Options(root=shm_root, job_id="late-state", keep=3, auto=False)) as ckpt:
        ckpt.snapshot()  # step 0: no optimizer state yet
        ckpt.wait()
        want = _steps(ckpt, net, opt, range(1))
        assert any(k.startswith("o.") for k in want)
        _perturb(net, opt)
        assert ckpt.restore() == 1
        assert _same(_values(net, opt), want)


def test_a_manifest_edited_in_place_is_read_again(shm_root: Path) -> None:
    """The store reuses a parsed manifest only while its file is unchanged: an edit that keeps its size (and a
    recomputed mtime) is still seen, and that version fails its check on a Checkpointer whose caches are warm."""
    net, opt = _model()
    with Checkpointer(net, opt, Options(root=shm_root, job_id="edited", keep=3, auto=False)) as ckpt:
        first = _steps(ckpt, net, opt, range(1))
        _steps(ckpt, net, opt, range(1, 2))
        assert ckpt.restore() == 2
        newest = max(ckpt.store.versions(), key=lambda v: v.step)
        path = ckpt.store.dir / f"slot-{newest.slot}.json"
        st = path.stat()
        raw = path.read_bytes()
        edited = raw.replace(b'"step":2,', b'"step":7,')
        assert edited != raw and len(edited) == len(raw)
        path.write_bytes(edited)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime: only the ctime moved
        _perturb(net, opt)
        assert ckpt.restore() == 1  # the edited manifest fails its checksum: the older version is loaded
        assert _same(_values(net, opt), first)


def test_the_restored_extra_is_the_callers_to_change(shm_root: Path) -> None:
    net, opt = _model()
    with Checkpointer(net, opt, Options(root=shm_root, job_id="extra", auto=False),
                      extra=lambda: {"pos": [1, 2]}) as ckpt:
        _steps(ckpt, net, opt, range(1))
        assert ckpt.restore() == 1
        ckpt.extra["pos"].append(3)  # a caller changing what it got must not change the store's cached manifest
        assert ckpt.restore() == 1
        assert ckpt.extra == {"pos": [1, 2]}
        assert json.dumps(ckpt.extra)
