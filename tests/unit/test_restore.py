"""Restore's chunk workers: many small chunks shared by several tensors and tensors spanning several chunks,
strided tensors, one to three workers, with and without the streaming-store kernel; a bad chunk in the
middle of the file still fails its version."""
from pathlib import Path

import pytest
import torch

from hpcft.checkpointer import Checkpointer
from hpcft.options import Options
from hpcft.store import ntcopy
from hpcft.snapshot.state import collect


class _Net(torch.nn.Module):
    """Sizes from 4 bytes to 64 KiB, one parameter strided (a transposed view)."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.big = torch.nn.Parameter(torch.randn(128, 128, generator=g))
        self.strided = torch.nn.Parameter(torch.randn(40, 24, generator=g).t())
        self.small = torch.nn.Parameter(torch.randn(3, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.big).sum() + (self.strided @ self.strided.t()).sum() * self.small.sum()


def _model(seed: int) -> tuple[_Net, torch.optim.Optimizer]:
    net = _Net(seed)
    return net, torch.optim.Adam(net.parameters(), lr=0.01)


def _train(net: _Net, opt: torch.optim.Optimizer, steps: int) -> None:
    for it in range(steps):
        net(torch.randn(2, 128, generator=torch.Generator().manual_seed(it))).backward()
        opt.step()
        opt.zero_grad()


def _state(net, opt) -> dict[str, torch.Tensor]:
    return {e.name: e.local.clone() for e in collect(net, opt, None)}


@pytest.mark.parametrize("threads,kernel", [(1, "1"), (2, "1"), (3, "0")])
def test_restore_is_bitwise_over_many_chunks(shm_root: Path, monkeypatch: pytest.MonkeyPatch, threads: int,
                                             kernel: str) -> None:
    monkeypatch.setenv("HPCFT_NTCOPY", kernel)
    monkeypatch.setattr(ntcopy, "_tried", False)
    monkeypatch.setattr(ntcopy, "_lib", None)  # put back afterwards: the tests after this one keep the kernel
    monkeypatch.setattr(ntcopy, "reason", ntcopy.reason)
    net, opt = _model(0)
    assert not net.strided.is_contiguous()
    with Checkpointer(net, opt, Options(root=shm_root, job_id="j", chunk_bytes=4096, threads=threads)) as ckpt:
        _train(net, opt, 3)  # three snapshots: the contiguous stand-in of a strided tensor is refreshed each time
        ckpt.wait()
        want = _state(net, opt)
    net2, opt2 = _model(7)
    _train(net2, opt2, 1)
    with Checkpointer(net2, opt2, Options(root=shm_root, job_id="j", chunk_bytes=4096, threads=threads)) as again:
        assert again.restore() == 3
        got = _state(net2, opt2)
    assert want.keys() == got.keys() and [k for k in want if not torch.equal(want[k], got[k])] == []


@pytest.mark.parametrize("in_c", [True, False])
def test_bad_middle_chunk_fails_its_version(shm_root: Path, monkeypatch: pytest.MonkeyPatch, in_c: bool) -> None:
    """In the C loop (every sink in host memory) and chunk by chunk from Python alike."""
    if in_c and not ntcopy.fused_available():
        pytest.skip(f"no C copy loop here: {ntcopy.reason or 'the CPU lacks SSE4.2/AVX2'}")
    if not in_c:
        monkeypatch.setattr(ntcopy, "chunk_copy", lambda kernel: None)
    net, opt = _model(0)
    with Checkpointer(net, opt, Options(root=shm_root, job_id="j", chunk_bytes=4096, threads=2)) as ckpt:
        _train(net, opt, 1)
        ckpt.wait()
        first = _state(net, opt)
        _train(net, opt, 1)
        ckpt.wait()
        newest = ckpt.store.versions()[-1]
        ckpt.store.slot(newest.slot).array[newest.manifest["data_bytes"] // 2] ^= 0x10
    net2, opt2 = _model(7)
    with Checkpointer(net2, opt2, Options(root=shm_root, job_id="j", chunk_bytes=4096, threads=2)) as again:
        assert again.restore() == 1
        got = _state(net2, opt2)
    assert all(torch.equal(first[k], got[k]) for k in first)


def test_the_c_loop_takes_a_restore_into_host_memory_and_plans_as_python_does(shm_root: Path) -> None:
    """Where the kernel library runs, a restore into host tensors (a strided one's staging buffer included) is one C
    call per worker, over the same segments as the chunk-by-chunk plan."""
    if not ntcopy.fused_available():
        pytest.skip(f"no C copy loop here: {ntcopy.reason or 'the CPU lacks SSE4.2/AVX2'}")
    net, opt = _model(0)
    with Checkpointer(net, opt, Options(root=shm_root, job_id="j", chunk_bytes=4096, threads=2)) as ckpt:
        _train(net, opt, 2)
        ckpt.wait()
        assert ckpt.restore() == 2
        grid, sinks, dst = ckpt._loader._dst
        table = grid.table()
        segments = [s for i in range(grid.count) for s in grid.chunk(i).segments]
        assert [(s.source, s.start, s.offset, s.nbytes) for s in segments] == \
            list(zip(*(a.tolist() for a in table[:4])))
        assert dst.tolist() == [sinks[s.source] + s.start for s in segments]


def test_a_snapshot_in_the_c_loop_writes_and_seals_what_the_python_path_does(shm_root: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The same state snapshotted by each workers' C call and chunk by chunk from Python: the same bytes in the slot
    and the same chunk table (crc32c of each chunk's bytes, padding included, sealed)."""
    if not ntcopy.fused_available():
        pytest.skip(f"no C copy loop here: {ntcopy.reason or 'the CPU lacks SSE4.2/AVX2'}")
    got = []
    for in_c in (True, False):
        if not in_c:
            monkeypatch.setattr(ntcopy, "chunk_copy", lambda kernel: None)
        net, opt = _model(0)
        _train(net, opt, 1)
        with Checkpointer(net, opt,
                          Options(root=shm_root, job_id=f"c{in_c}", chunk_bytes=4096, threads=2, auto=False)) as ckpt:
            assert (ckpt.engine.copier._chunk_copy is not None) == in_c
            ckpt.step(0)
            ckpt.wait()
            v = ckpt.store.versions()[-1]
            got.append((v.manifest["chunks"], bytes(ckpt.store.slot(v.slot).array[:v.manifest["data_bytes"]])))
    assert got[0] == got[1]
