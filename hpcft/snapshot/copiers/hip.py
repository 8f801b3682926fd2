"""hip backend: hip-python `hipMemcpyAsync` on a `hipStreamNonBlocking` stream into `hipHostRegister`ed
shm pages, ordered against torch's compute stream with HIP events. Thin on purpose: every HIP call goes
through `_call`, which checks its return code; the events' lifetimes are the shared logic's (stream.py)."""
from typing import Any, ContextManager

import torch

from hpcft.deps import require
from hpcft.errors import CheckpointError
from hpcft.snapshot import devcrc
from hpcft.snapshot.copiers.stream import StreamCopier


class HipCopier(StreamCopier):
    name = "hip"

    def __init__(self, device: torch.device, max_inflight_bytes: int = 256 << 20, crc_threads: int = 2):
        self.hip = require("hip.hip", "the hip snapshot backend")
        self.device = torch.device(device)
        self._call("hipSetDevice", self.device.index or 0)
        self.stream = self._call("hipStreamCreateWithFlags", self.hip.hipStreamNonBlocking)
        super().__init__(max_inflight_bytes, crc_threads, devcrc.for_device(self.device))

    def _call(self, name: str, *args: Any) -> Any:
        """`hip.<name>(*args)`: hip-python returns (hipError_t, *values); the value(s), or a CheckpointError
        naming the call and its code."""
        err, *values = getattr(self.hip, name)(*args)
        if err != self.hip.hipError_t.hipSuccess:
            raise CheckpointError(f"HIP call {name} failed on {self.device}: {getattr(err, 'name', err)} "
                                  f"(code {int(err)})")
        return values[0] if len(values) == 1 else (tuple(values) or None)

    def _compute_stream(self) -> int:  # where the training step runs
        return torch.cuda.current_stream(self.device).cuda_stream

    def _recorded(self, stream: Any) -> Any:
        """A new event recorded on `stream` (destroyed again if the record fails)."""
        event = self._call("hipEventCreateWithFlags", self.hip.hipEventDisableTiming)
        try:
            self._call("hipEventRecord", event, stream)
        except Exception:
            self._release(event)
            raise
        return event

    def _register(self, ptr: int, size: int) -> None:
        self._call("hipSetDevice", self.device.index or 0)  # the current device is per thread: the issuer's
        self._call("hipHostRegister", ptr, size, self.hip.hipHostRegisterDefault)

    def _unregister(self, ptr: int) -> None:
        self._call("hipHostUnregister", ptr)

    def _record_ready(self) -> Any:
        return self._recorded(self._compute_stream())

    def _wait_ready(self, ready: Any) -> None:
        self._call("hipSetDevice", self.device.index or 0)  # the current device is per thread: the issuer's
        self._call("hipStreamWaitEvent", self.stream, ready, 0)

    def _copy(self, host: torch.Tensor, offset: int, src: torch.Tensor, start: int, nbytes: int) -> None:
        self._call("hipMemcpyAsync", host.data_ptr() + offset, src.data_ptr() + start, nbytes,
                   self.hip.hipMemcpyKind.hipMemcpyDeviceToHost, self.stream)

    def _on_copy_stream(self) -> ContextManager:
        """This stream as torch's (Triton launches on torch's stream); hip-python handles give their address by `int()`
        or, in older releases, `as_c_void_p()`. A failure turns the device checksum off (StreamCopier._launch_crc)."""
        handle = self.stream
        address = int(handle) if hasattr(handle, "__int__") else handle.as_c_void_p().value
        return torch.cuda.stream(torch.cuda.ExternalStream(address, device=self.device))

    def _record(self) -> Any:
        return self._recorded(self.stream)

    def _synchronize(self, event: Any) -> None:
        self._call("hipEventSynchronize", event)

    def _release(self, event: Any) -> None:
        self._call("hipEventDestroy", event)

    def _compute_waits(self, event: Any) -> None:
        self._call("hipStreamWaitEvent", self._compute_stream(), event, 0)

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._call("hipStreamDestroy", self.stream)
