"""Copy + crc32c of a chunk with non-temporal (streaming) stores: a plain copy reads its destination into the cache
(read-for-ownership), writes it back later and evicts the source; streaming stores skip both. Three kernels
(`KERNELS`, chosen per machine by hpcft.snapshot.calibration): `fused` takes the crc32c in the copy's own pass,
`stream` checksums the source after, still in cache, `memcpy` is libc's. They are C (`_ntcopy.c`: AVX2 and SSE4.2 on
x86-64) that `pip install` builds here, loaded with ctypes (the calls release the GIL); nothing is compiled at run
time. Where it was not built, copies are memcpy with one warning per process (HPCFT_NTCOPY=0: on purpose)."""
import ctypes
import functools
import importlib.machinery
import logging
import os
import threading
from pathlib import Path
from typing import Callable

import numpy as np

from hpcft.store.checksum import crc32c

_log = logging.getLogger(__name__)

KERNELS = ("fused", "stream", "memcpy")  # cheapest first (fused reads each byte once); the index is the C `kind`
_NAME = "_ntcopy"  # the extension setup.py builds: hpcft.store._ntcopy (a plain C library, not a module)
FIX = "reinstall hpcft where a C compiler (gcc) is available: `pip install .` (or `make setup` in a checkout)"

_lib: ctypes.CDLL | None = None
_tried = False
_lock = threading.Lock()
reason = "not loaded yet"  # why the kernel is unavailable (for logs and the bench), "" when it is loaded


def kernel_path() -> Path | None:
    """The kernel library `pip install` built into this package, or None where it was not built."""
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if (path := here / f"{_NAME}{suffix}").is_file():
            return path
    return None


def _open() -> ctypes.CDLL | None:
    """Load the built kernel; None (with `reason` set) where it is switched off, absent or unloadable."""
    global reason
    if os.environ.get("HPCFT_NTCOPY", "1") == "0":
        reason = "disabled by HPCFT_NTCOPY=0"
        return None
    path = kernel_path()
    if path is None:
        reason = f"the streaming-store copy kernel was not built at install time; copies use memcpy ({FIX})"
        return None
    try:
        lib = ctypes.CDLL(str(path))
        lib.hpcft_stream_copy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        lib.hpcft_stream_copy.restype = None
        lib.hpcft_copy_crc32c_supported.restype = ctypes.c_int
        for name in ("hpcft_copy_crc32c", "hpcft_stream_copy_crc32c"):
            getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32]
            getattr(lib, name).restype = ctypes.c_uint32
        p, i, u64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64
        lib.hpcft_copy_chunks.argtypes = [p, p, p, p, p, p, u64, p, ctypes.c_uint32, i, p, i, i]
        lib.hpcft_copy_chunks.restype = None
        lib.hpcft_populate.argtypes = [p, u64, u64, p, p, p]
        lib.hpcft_populate.restype = None
    except (OSError, AttributeError) as exc:
        reason = f"the streaming-store copy kernel {path} cannot be loaded ({exc}); copies use memcpy ({FIX})"
        return None
    reason = ""
    return lib


def _load() -> ctypes.CDLL | None:
    """The kernel, loaded on first use; where it cannot be had, one warning per process and None."""
    global _lib, _tried
    with _lock:
        if not _tried:
            _lib = _open()
            _tried = True
            if _lib is None and not reason.startswith("disabled"):
                _log.warning("hpcft: %s", reason)
    return _lib


def probe() -> tuple[bool, str]:
    """(built and loadable, what to tell a person) without the run-time warning: for `hpcft doctor`."""
    lib = _open()
    return lib is not None, (f"built: {kernel_path()}" if lib is not None else reason)


def available() -> bool:
    """True when copies use the streaming-store kernel built at install time."""
    return _load() is not None


def fused_available() -> bool:
    """True where the fused copy + crc32c kernel was built and this CPU runs it (x86-64 with SSE4.2 and AVX2)."""
    lib = _load()
    return lib is not None and bool(lib.hpcft_copy_crc32c_supported())


def kernels() -> tuple[str, ...]:
    """The kernels that run here, cheapest first (`KERNELS` less those not built or not supported by the CPU)."""
    return tuple(k for k in KERNELS if k == "memcpy" or (k == "stream" and available())
                 or (k == "fused" and fused_available()))


def raw_copier(kernel: str = "stream") -> Callable[[int, int, int], None]:
    """`f(dst, src, nbytes)` copying between raw addresses (kept alive and in bounds by the caller): the streaming
    kernel (`stream` or `fused`, where built), else libc memcpy through ctypes. Both release the GIL."""
    lib = _load() if kernel != "memcpy" else None
    return ctypes.memmove if lib is None else lib.hpcft_stream_copy


def raw_copy_crc(kernel: str = "fused") -> Callable[[int, int, int, int], int]:
    """`f(dst, src, nbytes, crc)`: copy between raw addresses (as `raw_copier`), return the source's crc32c continuing
    `crc`: `fused` in one pass, `stream` as one C call (copy, then crc32c while in cache) where the CPU runs them,
    else the copy and the crc32c package. Every snapshot, restore and calibration copy goes through here."""
    if kernel in ("fused", "stream") and fused_available():  # one C call a segment: a restore makes ~1600
        return _load().hpcft_copy_crc32c if kernel == "fused" else _load().hpcft_stream_copy_crc32c
    copy = raw_copier("stream" if kernel == "fused" else kernel)

    def copy_then_crc(dst: int, src: int, nbytes: int, crc: int) -> int:
        copy(dst, src, nbytes)
        return crc32c((ctypes.c_char * nbytes).from_address(src), crc) if nbytes else crc
    return copy_then_crc


class ChunkCopy:
    """One snapshot's or restore's chunks for `hpcft_copy_chunks`: every worker calls `run()` (no GIL) and they share
    one counter, so a slowed worker takes fewer chunks; then `crcs` holds each chunk's crc32c, sealed with `key` if
    given. `addr`, `off`, `n`, `first`, `bounds` as plan.Table's; `to_slot`: into the slot (a snapshot), else out."""

    def __init__(self, kernel: str, slot: int, addr: np.ndarray, off: np.ndarray, n: np.ndarray, first: np.ndarray,
                 bounds: np.ndarray, key: int | None = None, to_slot: bool = False):
        if kernel not in KERNELS:
            raise ValueError(f"unknown copy kernel {kernel!r}: one of {', '.join(KERNELS)}")
        self._lib = _load()
        self._kind = KERNELS.index(kernel)  # hpcft_copy_chunks's `kind`
        self._arrays = [np.ascontiguousarray(a, dtype=np.uint64) for a in (addr, off, n, first, bounds)]
        self.count = len(bounds) - 1
        self.crcs = np.zeros(self.count, dtype=np.uint32)
        self._next = np.zeros(1, dtype=np.uint64)
        self._slot, self._key, self._to_slot = slot, key, to_slot

    def run(self) -> None:
        lib, (addr, off, n, first, bounds) = self._lib, self._arrays
        lib.hpcft_copy_chunks(self._slot, address(addr), address(off), address(n), address(first), address(bounds),
                              self.count, address(self._next), self._key or 0, self._key is not None,
                              address(self.crcs), self._kind, self._to_slot)


def chunk_copy(kernel: str) -> Callable[..., ChunkCopy] | None:
    """ChunkCopy with `kernel` (its other arguments to come) where its C loop runs here (built, SSE4.2 and AVX2),
    else None: the caller copies through `raw_copy_crc` instead."""
    return functools.partial(ChunkCopy, kernel) if fused_available() else None


def populate_loop() -> Callable[[int, int, int, int, int, int], None] | None:
    """`hpcft_populate(base, n, piece, next, done, failed)` (prefetch's pieces with no GIL between them) where the
    kernel library is loaded, else None."""
    lib = _load()
    return None if lib is None else lib.hpcft_populate


def address(a: np.ndarray) -> int:
    """The address of an array's first byte."""
    return a.__array_interface__["data"][0]


def copy(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[:] = src for two arrays of one dtype and size; streaming stores when both are C-contiguous and the kernel
    is available."""
    if _raw(dst, src):
        raw_copier()(address(dst), address(src), src.nbytes)
    else:
        np.copyto(dst, src)


def copy_crc(dst: np.ndarray, src: np.ndarray, crc: int = 0, kernel: str = "fused") -> int:
    """`copy`, returning the crc32c of `src` continuing `crc` (`raw_copy_crc`'s `kernel` for C-contiguous arrays)."""
    if _raw(dst, src):
        return raw_copy_crc(kernel)(address(dst), address(src), src.nbytes, crc)
    np.copyto(dst, src)
    return crc32c(src, crc)


def _raw(dst: np.ndarray, src: np.ndarray) -> bool:
    """Whether `dst` and `src` are both C-contiguous (copied by address); ValueError unless of one size."""
    if dst.nbytes != src.nbytes:
        raise ValueError(f"copy of {src.nbytes} bytes into {dst.nbytes}")
    return dst.flags.c_contiguous and src.flags.c_contiguous
