"""torch backend (CUDA and ROCm, both `torch.cuda`): non_blocking copies on a dedicated stream into shm
pages registered with cudaHostRegister (hipHostRegister on ROCm builds)."""
from typing import Any, ContextManager

import torch

from hpcft.errors import CheckpointError
from hpcft.snapshot import devcrc
from hpcft.snapshot.copiers.stream import StreamCopier


class TorchCopier(StreamCopier):
    name = "torch"

    def __init__(self, device: torch.device, max_inflight_bytes: int = 256 << 20, crc_threads: int = 2):
        super().__init__(max_inflight_bytes, crc_threads, devcrc.for_device(device))
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)
        self._cudart = torch.cuda.cudart()

    def _register(self, ptr: int, size: int) -> None:
        with torch.cuda.device(self.device):  # the issuing thread's current device is not the training thread's
            rc = self._cudart.cudaHostRegister(ptr, size, 0)
        if int(rc) != 0:
            raise CheckpointError(f"cudaHostRegister of {size} bytes of the store failed (error {int(rc)}); "
                                  "is the locked-memory limit (ulimit -l) too low?")

    def _unregister(self, ptr: int) -> None:
        self._cudart.cudaHostUnregister(ptr)

    def _record_ready(self) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _wait_ready(self, ready: Any) -> None:
        self.stream.wait_event(ready)

    def _copy(self, host: torch.Tensor, offset: int, src: torch.Tensor, start: int, nbytes: int) -> None:
        # `host` views the registered pages, so torch takes them for pinned memory: cudaMemcpyAsync
        with torch.cuda.stream(self.stream):
            host[offset:offset + nbytes].copy_(src[start:start + nbytes], non_blocking=True)

    def _on_copy_stream(self) -> ContextManager:
        return torch.cuda.stream(self.stream)

    def _record(self) -> Any:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def _synchronize(self, event: Any) -> None:
        event.synchronize()

    def _compute_waits(self, event: Any) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)
