"""Copy + crc32c of a chunk with non-temporal (streaming) stores: a large copy whose destination is not read
soon should not pull that destination into the cache first. A plain 1 MiB copy reads the destination
(read-for-ownership), writes it back later, and evicts the source; streaming stores skip both, so a chunk
costs one read of the source and one write, and its source stays in cache for the crc32c that follows.

The kernel is a few lines of C (AVX2 streaming stores on x86-64; memcpy on other CPUs), compiled with the
system C compiler on first use into a per-user cache directory and loaded with ctypes (the call releases
the GIL). Without a compiler, or with HPCFT_NTCOPY=0, copies are libc's memcpy: same bytes, same results.
"""
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable

import numpy as np

from hpcft.store.checksum import crc32c

_log = logging.getLogger(__name__)

_SOURCE = r"""
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
__attribute__((target("avx2"))) static size_t stream_avx2(char *d, const char *s, size_t n) {
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(s + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(s + i + 64));
        __m256i e = _mm256_loadu_si256((const __m256i *)(s + i + 96));
        _mm256_stream_si256((__m256i *)(d + i), a);
        _mm256_stream_si256((__m256i *)(d + i + 32), b);
        _mm256_stream_si256((__m256i *)(d + i + 64), c);
        _mm256_stream_si256((__m256i *)(d + i + 96), e);
    }
    return i;
}
#endif

/* dst[0:n] = src[0:n]; streaming stores for all but the unaligned head and the tail (AVX2 CPUs, n >= 4 KiB). */
void hpcft_stream_copy(void *dst, const void *src, size_t n) {
    char *d = (char *)dst;
    const char *s = (const char *)src;
#if defined(__x86_64__)
    static int avx2 = -1;
    if (avx2 < 0) {
        __builtin_cpu_init();
        avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
    }
    if (avx2 && n >= 4096) {
        size_t head = (32 - ((uintptr_t)d & 31)) & 31;
        memcpy(d, s, head);
        d += head; s += head; n -= head;
        size_t done = stream_avx2(d, s, n);
        _mm_sfence();
        d += done; s += done; n -= done;
    }
#endif
    memcpy(d, s, n);
}
"""

_lib: ctypes.CDLL | None = None
_tried = False
_lock = threading.Lock()
reason = "not loaded yet"  # why the kernel is unavailable (for logs and the bench), "" when it is loaded


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hpcft"


def _build(target: Path) -> None:
    """Compile the kernel into `target` (atomically: a half-written library is never loaded)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise OSError("no C compiler (cc/gcc) on PATH")
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src, out = Path(tmp) / "ntcopy.c", Path(tmp) / target.name
        src.write_text(_SOURCE)
        run = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(out), str(src)],
                             capture_output=True, text=True, timeout=120)
        if run.returncode != 0:
            raise OSError(f"{cc} failed: {run.stderr.strip()[-500:]}")
        os.replace(out, target)


def _trusted(path: Path) -> bool:
    st = path.stat()
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def _load() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use; None (with `reason` set) where it cannot be had."""
    global _lib, _tried
    with _lock:
        if not _tried:
            _lib = _open()
            _tried = True
    return _lib


def _open() -> ctypes.CDLL | None:
    """Load the cached library, building it first if missing or not trustworthy."""
    global reason
    if os.environ.get("HPCFT_NTCOPY", "1") == "0":
        reason = "disabled by HPCFT_NTCOPY=0"
        return None
    key = hashlib.sha256(_SOURCE.encode()).hexdigest()[:16]
    path = _cache_dir() / f"ntcopy-{key}-{platform.machine()}.so"
    try:
        if not (path.exists() and _trusted(path)):
            _build(path)
        lib = ctypes.CDLL(str(path))
        lib.hpcft_stream_copy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        lib.hpcft_stream_copy.restype = None
    except (OSError, subprocess.SubprocessError) as exc:
        reason = f"streaming-store copy unavailable, using memcpy ({exc})"
        _log.info(reason)
        return None
    reason = ""
    return lib


def available() -> bool:
    """True when copies use the compiled streaming-store kernel (built now if needed)."""
    return _load() is not None


def raw_copier() -> Callable[[int, int, int], None]:
    """`f(dst, src, nbytes)` copying between raw addresses (the caller keeps both buffers alive and in
    bounds): the streaming-store kernel, else libc memcpy through ctypes. Both release the GIL."""
    lib = _load()
    return ctypes.memmove if lib is None else lib.hpcft_stream_copy


def address(a: np.ndarray) -> int:
    """The address of an array's first byte."""
    return a.__array_interface__["data"][0]


def copy(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[:] = src for two arrays of one dtype and size; streaming stores when both are C-contiguous and
    the kernel is available."""
    if dst.nbytes != src.nbytes:
        raise ValueError(f"copy of {src.nbytes} bytes into {dst.nbytes}")
    if dst.flags.c_contiguous and src.flags.c_contiguous:
        raw_copier()(address(dst), address(src), src.nbytes)
    else:
        np.copyto(dst, src)


def copy_crc(dst: np.ndarray, src: np.ndarray, crc: int = 0) -> int:
    """Copy `src` into `dst` (see `copy`) and return the crc32c of `src` continuing `crc`: the source is
    read while still in cache from the copy; the destination, written around the cache, is not read."""
    copy(dst, src)
    return crc32c(src, crc)
