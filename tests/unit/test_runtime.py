"""hpcft.init(): layout arithmetic, and a real single-rank gloo init from launcher-style variables."""
import socket
import threading
import time

import pytest
import torch

from hpcft.errors import ConfigError, RendezvousError
from hpcft.runtime import init, resolve_layout, wait_listening


def test_resolve_layout() -> None:
    assert resolve_layout(8, None, 2, 1) == (4, 2, 1)
    assert resolve_layout(8, 2, 2, 2) == (2, 2, 2)
    with pytest.raises(ConfigError, match="not divisible"):
        resolve_layout(6, None, 4, 1)
    with pytest.raises(ConfigError, match="does not match world size 8"):
        resolve_layout(8, 3, 2, 1)
    with pytest.raises(ConfigError, match="tp must be a positive"):
        resolve_layout(8, None, 0, 1)


def test_init_single_rank_from_launcher_variables() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"HPCFT_RANK": "0", "HPCFT_WORLD_SIZE": "1", "HPCFT_LOCAL_RANK": "0", "HPCFT_JOB_ID": "77",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    ctx = init(environ=env)
    try:
        assert (ctx.rank, ctx.world, ctx.job_id, ctx.backend) == (0, 1, "77", "gloo")
        assert ctx.device == torch.device("cpu") and (ctx.dp, ctx.tp, ctx.pp) == (1, 1, 1)
        assert ctx.mesh.mesh_dim_names == ("pp", "dp", "tp") and ctx.dp_rank == 0
        t = torch.ones(2)
        torch.distributed.all_reduce(t, group=ctx.dp_group)
        assert torch.equal(t, torch.ones(2))
    finally:
        ctx.close()


def test_gpu_groups_carry_cpu_tensors_too() -> None:
    """On GPUs the default group maps cuda to NCCL/RCCL and cpu to gloo: NCCL alone refuses CPU tensors."""
    from hpcft.runtime import default_backend

    assert default_backend(torch.device("cuda", 3)) == "cpu:gloo,cuda:nccl"
    assert default_backend(torch.device("cpu")) == "gloo"


def test_which_groups_carry_cpu_tensors() -> None:
    """hpcft pairs a group with a gloo one exactly when the group's backends leave out the CPU."""
    import torch.distributed as dist

    from hpcft.snapshot.groups import carries

    store = dist.HashStore()
    dist.init_process_group("cuda:gloo", store=store, rank=0, world_size=1)
    try:
        assert not carries(dist.group.WORLD, "cpu") and carries(dist.group.WORLD, "cuda")
        assert carries(dist.new_group(backend="gloo"), "cpu")
    finally:
        dist.destroy_process_group()


def test_wait_listening_returns_once_the_port_listens_and_fails_clearly_at_the_deadline() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        late = threading.Timer(0.2, s.listen)
        t0 = time.monotonic()
        late.start()
        assert wait_listening("127.0.0.1", port, timeout_s=5.0)
        assert 0.15 < time.monotonic() - t0 < 2.0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(RendezvousError, match=f"nothing listens on 127.0.0.1:{closed} .* after 0.2 s.*rank 0"):
        wait_listening("127.0.0.1", closed, timeout_s=0.2)
    assert time.monotonic() - t0 < 1.5
    assert not wait_listening("no-such-host.invalid", port, timeout_s=5.0)
