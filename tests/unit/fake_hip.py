"""A stand-in for hip-python's `hip.hip` with the calls the hip copier makes, for CPU-only CI: the same
signatures and `(hipError_t, *values)` returns, host memory playing device memory, and the bookkeeping a
real runtime does (unknown or destroyed handles, double registration) turned into error codes, with counts
of what was created and destroyed. `fail[name] = code` makes the next call of `name` return that code."""
import ctypes
import enum
import itertools
import threading
from collections import Counter


class hipError_t(enum.IntEnum):
    hipSuccess = 0
    hipErrorInvalidValue = 1
    hipErrorInvalidDevice = 101
    hipErrorInvalidResourceHandle = 400
    hipErrorHostMemoryAlreadyRegistered = 712
    hipErrorHostMemoryNotRegistered = 713


class hipMemcpyKind(enum.IntEnum):
    hipMemcpyHostToHost = 0
    hipMemcpyHostToDevice = 1
    hipMemcpyDeviceToHost = 2
    hipMemcpyDeviceToDevice = 3
    hipMemcpyDefault = 4


class FakeHip:
    hipError_t = hipError_t
    hipMemcpyKind = hipMemcpyKind
    hipStreamNonBlocking = 1
    hipEventDisableTiming = 2
    hipHostRegisterDefault = 0

    def __init__(self, devices: int = 1):
        self.devices = devices
        self.streams: dict[int, bool] = {}  # live stream -> True
        self.events: dict[int, bool] = {}  # live event -> recorded
        self.registered: dict[int, int] = {}  # ptr -> size
        self.created: Counter = Counter()
        self.destroyed: Counter = Counter()
        self.calls: Counter = Counter()
        self.fail: dict[str, hipError_t] = {}
        self.peak_events = 0
        self._handles = itertools.count(0x1000)
        self._lock = threading.Lock()

    def _enter(self, name: str) -> hipError_t | None:
        self.calls[name] += 1
        return self.fail.pop(name, None)

    def _destroy(self, name: str, live: dict, handle, kind: str, missing: hipError_t):
        """The destroy/unregister calls: `missing` for a handle that is not (or no longer) live."""
        if err := self._enter(name):
            return (err,)
        with self._lock:
            if handle not in live:
                return (missing,)
            del live[handle]
            self.destroyed[kind] += 1
        return (hipError_t.hipSuccess,)

    def _stream_ok(self, stream) -> bool:
        return stream in (0, None) or stream in self.streams

    def hipSetDevice(self, device: int):
        if err := self._enter("hipSetDevice"):
            return (err,)
        return (hipError_t.hipSuccess if 0 <= device < self.devices else hipError_t.hipErrorInvalidDevice,)

    def _create(self, name: str, live: dict, kind: str, value: bool):
        """The create calls: (hipSuccess, a new handle), now live."""
        if err := self._enter(name):
            return (err, None)
        with self._lock:
            handle = next(self._handles)
            live[handle] = value
            self.created[kind] += 1
            self.peak_events = max(self.peak_events, len(self.events))
        return (hipError_t.hipSuccess, handle)

    def hipStreamCreateWithFlags(self, flags: int):
        return self._create("hipStreamCreateWithFlags", self.streams, "stream", True)

    def hipStreamDestroy(self, stream):
        return self._destroy("hipStreamDestroy", self.streams, stream, "stream", hipError_t.hipErrorInvalidResourceHandle)

    def hipEventCreateWithFlags(self, flags: int):
        return self._create("hipEventCreateWithFlags", self.events, "event", False)  # not recorded yet

    def hipEventDestroy(self, event):
        return self._destroy("hipEventDestroy", self.events, event, "event", hipError_t.hipErrorInvalidResourceHandle)

    def hipEventRecord(self, event, stream):
        if err := self._enter("hipEventRecord"):
            return (err,)
        with self._lock:
            if event not in self.events or not self._stream_ok(stream):
                return (hipError_t.hipErrorInvalidResourceHandle,)
            self.events[event] = True
        return (hipError_t.hipSuccess,)

    def hipEventSynchronize(self, event):
        if err := self._enter("hipEventSynchronize"):
            return (err,)
        ok = self.events.get(event)  # copies are done when issued: a recorded event has completed
        return (hipError_t.hipSuccess if ok else hipError_t.hipErrorInvalidResourceHandle,)

    def hipStreamWaitEvent(self, stream, event, flags: int):
        if err := self._enter("hipStreamWaitEvent"):
            return (err,)
        ok = self._stream_ok(stream) and self.events.get(event) and flags == 0
        return (hipError_t.hipSuccess if ok else hipError_t.hipErrorInvalidResourceHandle,)

    def hipHostRegister(self, ptr: int, size: int, flags: int):
        if err := self._enter("hipHostRegister"):
            return (err,)
        with self._lock:
            if any(p < ptr + size and ptr < p + n for p, n in self.registered.items()):
                return (hipError_t.hipErrorHostMemoryAlreadyRegistered,)
            self.registered[ptr] = size
            self.created["registration"] += 1
        return (hipError_t.hipSuccess,)

    def hipHostUnregister(self, ptr: int):
        return self._destroy("hipHostUnregister", self.registered, ptr, "registration",
                             hipError_t.hipErrorHostMemoryNotRegistered)

    def hipMemcpyAsync(self, dst: int, src: int, nbytes: int, kind, stream):
        if err := self._enter("hipMemcpyAsync"):
            return (err,)
        pinned = any(p <= dst and dst + nbytes <= p + n for p, n in self.registered.items())
        if kind != hipMemcpyKind.hipMemcpyDeviceToHost or not self._stream_ok(stream) or not pinned:
            return (hipError_t.hipErrorInvalidValue,)
        ctypes.memmove(dst, src, nbytes)  # the 'device' finishes at once; ordering is the copier's business
        return (hipError_t.hipSuccess,)

    def live(self) -> dict[str, int]:
        """What is still held: events, streams, registrations."""
        return {"event": len(self.events), "stream": len(self.streams), "registration": len(self.registered)}
