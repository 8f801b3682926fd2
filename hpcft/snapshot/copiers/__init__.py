"""Copy-level backends behind one Protocol: `torch` (CUDA/ROCm streams), `hip` (hip-python), `cpu`."""
import logging

import torch

from hpcft.deps import available
from hpcft.env import usable_cores
from hpcft.errors import ConfigError
from hpcft.snapshot.copiers.base import Copier, Transfer
from hpcft.snapshot.copiers.cpu import CpuCopier

_log = logging.getLogger(__name__)


def choose(backend: str, device: torch.device) -> str:
    """`auto` → hip on a GPU of a ROCm build where hip-python imports, torch on any other GPU, cpu otherwise. An
    explicit choice is checked against the device, never silently replaced."""
    on_gpu = device.type == "cuda"
    if backend == "auto":
        if not on_gpu:
            return "cpu"
        return "hip" if torch.version.hip and available("hip.hip") else "torch"
    if backend in ("torch", "hip") and not on_gpu:
        raise ConfigError(f"snapshot backend {backend!r} needs the model on a GPU (it is on {device}); "
                          "use Options(backend='cpu') or 'auto'")
    return backend


def cpu_overlap(threads: int) -> bool:
    """Overlap CPU copies with training only where torch's compute threads leave cores idle; otherwise a background
    copy fights the step for them and costs more than a short parallel copy while the step waits."""
    return usable_cores() >= torch.get_num_threads() + threads


def default_threads(backend: str) -> int:
    """Copy/checksum threads per rank: on a CPU no more than torch computes with (up to 4); next to a GPU
    4, whatever torch's CPU thread count (host checksums must keep up with a ~50 GB/s device→host copy)."""
    return max(1, min(4, torch.get_num_threads())) if backend == "cpu" else 4


def make(backend: str, device: torch.device, *, max_inflight_bytes: int, threads: int, overlap: bool | None = None,
         kernel: str = "stream") -> Copier:
    """Build the copier named by `choose` (cpu backend: `overlap` defaults to `cpu_overlap(threads)`)."""
    if backend == "cpu":
        overlap = cpu_overlap(threads) if overlap is None else overlap
        return CpuCopier(threads=threads, overlap=overlap, kernel=kernel)
    if backend == "torch":
        from hpcft.snapshot.copiers.torch_stream import TorchCopier as Stream
    else:
        from hpcft.snapshot.copiers.hip import HipCopier as Stream
    copier = Stream(device, max_inflight_bytes, crc_threads=threads)
    copier.warm_up()
    return copier


__all__ = ["Copier", "CpuCopier", "Transfer", "choose", "cpu_overlap", "default_threads", "make"]
