"""hip backend: hip-python `hipMemcpyAsync` on a `hipStreamNonBlocking` stream into `hipHostRegister`ed
shm pages. Thin on purpose: ordering against torch's compute stream goes through HIP events."""
from typing import Any

import torch

from hpcft.deps import require
from hpcft.errors import CheckpointError
from hpcft.snapshot.copiers.stream import StreamCopier


def _check(result: Any) -> Any:
    """hip-python returns (hipError_t, *values); raise on an error, return the value(s)."""
    hip = _hip()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != hip.hipError_t.hipSuccess:
        raise CheckpointError(f"HIP call failed: {err}")
    return values[0] if len(values) == 1 else values


def _hip() -> Any:
    return require("hip.hip", "the hip snapshot backend")


class HipCopier(StreamCopier):
    name = "hip"

    def __init__(self, device: torch.device, max_inflight_bytes: int = 256 << 20, crc_threads: int = 2):
        super().__init__(max_inflight_bytes, crc_threads)
        self.hip = _hip()
        self.device = torch.device(device)
        _check(self.hip.hipSetDevice(self.device.index or 0))
        self.stream = _check(self.hip.hipStreamCreateWithFlags(self.hip.hipStreamNonBlocking))

    def _event(self) -> Any:
        return _check(self.hip.hipEventCreateWithFlags(self.hip.hipEventDisableTiming))

    def _register(self, ptr: int, size: int) -> None:
        _check(self.hip.hipHostRegister(ptr, size, self.hip.hipHostRegisterDefault))

    def _unregister(self, ptr: int) -> None:
        self.hip.hipHostUnregister(ptr)

    def _record_ready(self) -> Any:
        event = self._event()
        _check(self.hip.hipEventRecord(event, torch.cuda.current_stream(self.device).cuda_stream))
        return event

    def _wait_ready(self, ready: Any) -> None:
        _check(self.hip.hipSetDevice(self.device.index or 0))
        _check(self.hip.hipStreamWaitEvent(self.stream, ready, 0))

    def _copy(self, host: torch.Tensor, offset: int, src: torch.Tensor, start: int, nbytes: int) -> None:
        if src.device.type != "cuda":  # a host-side scalar (e.g. Adam's step): plain copy
            host[offset:offset + nbytes].copy_(src[start:start + nbytes])
            return
        _check(self.hip.hipMemcpyAsync(host.data_ptr() + offset, src.data_ptr() + start, nbytes,
                                       self.hip.hipMemcpyKind.hipMemcpyDeviceToHost, self.stream))

    def _record(self) -> Any:
        event = self._event()
        _check(self.hip.hipEventRecord(event, self.stream))
        return event

    def _synchronize(self, event: Any) -> None:
        _check(self.hip.hipEventSynchronize(event))
        self.hip.hipEventDestroy(event)

    def _compute_waits(self, event: Any) -> None:
        _check(self.hip.hipStreamWaitEvent(torch.cuda.current_stream(self.device).cuda_stream, event, 0))

    def close(self) -> None:
        super().close()
        self.hip.hipStreamDestroy(self.stream)
