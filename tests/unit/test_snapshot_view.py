"""The state is collected once per layout (snapshot.view): later snapshots only walk pointers. Whatever changes
the layout or moves a tensor (optimizer state created, a parameter's storage replaced, a buffer reassigned, the
optimizer's state loaded anew) is collected again, and every snapshot restores to the live values of its step."""
from pathlib import Path

import torch

import pytest

from hpcft.checkpointer import Checkpointer
from hpcft.options import Options
from hpcft.snapshot import state
from hpcft.snapshot.view import StateView


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.norm = torch.nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x)).sum()


def _step(net: _Net, opt: torch.optim.Optimizer, it: int) -> None:
    net(torch.randn(4, 8, generator=torch.Generator().manual_seed(it))).backward()
    opt.step()
    opt.zero_grad()


def _values(net: _Net, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"m.{k}": v.clone() for k, v in net.state_dict().items()}
    out.update({f"o.{i}.{k}": v.clone() for i, s in opt.state_dict()["state"].items() for k, v in s.items()})
    return out


def test_collected_once_while_nothing_moves() -> None:
    net = _Net()
    opt = torch.optim.AdamW(net.parameters())
    view = StateView(net, opt, None)
    first = view.entries()
    _step(net, opt, 0)  # the optimizer's state appears: collected again
    second = view.entries()
    assert second is not first and view.collections == 2
    for it in range(1, 20):
        _step(net, opt, it)
        assert view.entries() is second
    assert view.collections == 2


def test_a_moved_tensor_is_collected_again() -> None:
    net = _Net()
    opt = torch.optim.AdamW(net.parameters())
    _step(net, opt, 0)
    view = StateView(net, opt, None)
    before = view.entries()
    net.lin.weight.data = net.lin.weight.data.clone()  # new storage under the same Parameter
    assert view.entries() is not before
    before = view.entries()
    net.norm.running_mean = torch.zeros(8)  # a buffer reassigned
    assert view.entries() is not before
    before = view.entries()
    opt.load_state_dict(opt.state_dict())  # new optimizer state tensors
    after = view.entries()
    assert after is not before
    live = {e.name: e.local.data_ptr() for e in after}
    assert live["model/norm.running_mean"] == net.norm.running_mean.data_ptr()
    assert live["optim/lin.weight/exp_avg"] == opt.state[net.lin.weight]["exp_avg"].data_ptr()


def test_every_snapshot_restores_its_own_step_across_moves(shm_root: Path) -> None:
    torch.manual_seed(0)
    net = _Net()
    opt = torch.optim.AdamW(net.parameters())
    saved = {}
    with Checkpointer(net, opt, Options(root=shm_root, job_id="view", keep=8)) as ckpt:
        for it in range(6):
            if it == 3:
                net.lin.bias.data = net.lin.bias.data.clone()
                opt.load_state_dict(opt.state_dict())
            _step(net, opt, it)
            ckpt.wait()
            saved[it + 1] = _values(net, opt)
    torch.manual_seed(1)
    net2 = _Net()
    opt2 = torch.optim.AdamW(net2.parameters())
    with Checkpointer(net2, opt2, Options(root=shm_root, job_id="view", keep=8)) as again:
        assert again.restore() == 6
        now = _values(net2, opt2)
    assert now.keys() == saved[6].keys()
    assert all(torch.equal(now[k], v) for k, v in saved[6].items())


def test_the_cached_optimizer_shape_still_records_the_live_settings_and_scalars() -> None:
    net = _Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
    _step(net, opt, 0)
    view = StateView(net, opt, None)
    first = view.entries()
    for p in net.parameters():
        opt.state[p]["seen"] = 1  # a non-tensor per-parameter value appears: a new key, collected again
    opt.param_groups[0]["lr"] = 0.25  # a scheduler's change: no new layout, read at every snapshot
    assert view.entries() is not first
    opt.state[net.lin.weight]["seen"] = 7
    meta = state.optimizer_meta(opt, view.optim_shape)
    assert meta["param_groups"][0]["lr"] == 0.25
    assert meta["scalars"]["lin.weight/seen"] == 7 and meta["scalars"]["norm.bias/seen"] == 1
    assert meta["group_params"] == [[n for n, _ in net.named_parameters()]]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_copy_on_the_training_thread_is_counted_apart_from_the_start(shm_root: Path, overlap: bool) -> None:
    net = _Net()
    opt = torch.optim.AdamW(net.parameters())
    with Checkpointer(net, opt, Options(root=shm_root, job_id=f"inline-{overlap}", overlap=overlap)) as ckpt:
        for it in range(4):
            _step(net, opt, it)
        ckpt.wait()
        st = ckpt.stats
    assert st.snapshots == 4 and st.start_s > 0
    assert (st.inline_copy_s == 0) if overlap else (st.inline_copy_s > 0)
    assert st.start_s + st.inline_copy_s <= st.blocked_s + 1e-9
