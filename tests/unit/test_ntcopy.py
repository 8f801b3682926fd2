"""The copy kernels: the same bytes as numpy for any size and alignment, the source's crc32c (the fused kernel's
lanes and their joins included); built by the install (never at run time), and memcpy with one warning where it
was not built."""
import logging
from pathlib import Path

import numpy as np
import pytest

from hpcft.store import ntcopy
from hpcft.store import crc32c


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch):
    """ntcopy as on first use in a new process."""
    monkeypatch.setattr(ntcopy, "_tried", False)
    monkeypatch.setattr(ntcopy, "_lib", None)
    return ntcopy


# around the fused kernel's block sizes (four lanes of 32 KiB, 4 KiB, 256 B) and their sums, plus a head; the
# copies' prefetches reach past a segment's end, which must stay harmless (a prefetch never faults)
SIZES = (0, 1, 31, 33, 767, 1023, 1024, 1025, 4095, 4096, 4097, 16384 + 1024 + 5, 70000, 4 * 32768 - 1, 4 * 32768,
         4 * 32768 + 16384 + 1024 + 64, 1 << 19, (1 << 20) - 3)


def _copies_exactly(kernels: tuple[str, ...] = ntcopy.KERNELS) -> None:
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    for kernel in kernels:
        for n in SIZES:
            for a, b in ((0, 0), (1, 0), (0, 7), (13, 45)):
                n = min(n, src.size - a)
                dst = np.full(n + 128, 0xAB, dtype=np.uint8)
                assert ntcopy.copy_crc(dst[b:b + n], src[a:a + n], 7, kernel) == crc32c(src[a:a + n], 7), (kernel, n)
                assert np.array_equal(dst[b:b + n], src[a:a + n]), (kernel, n, a, b)
                assert (dst[:b] == 0xAB).all() and (dst[b + n:] == 0xAB).all()  # nothing outside written


def test_the_fused_kernel_runs_where_the_cpu_has_sse42_and_avx2() -> None:
    """This project's machines (x86-64 with AVX2) run all three kernels, the cheapest first (the default); a CPU
    without the instructions (as /proc/cpuinfo says) never gets the fused one."""
    flags = set(next((l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags")), "").split())
    want = ("fused", "stream", "memcpy") if {"sse4_2", "avx2"} <= flags else ("stream", "memcpy")
    assert ntcopy.kernels() == want


def test_installed_kernel_loads_and_copies_exactly(fresh, caplog: pytest.LogCaptureFixture) -> None:
    """`make setup` (pip install -e) builds the kernel into the package, where the copies find it."""
    assert fresh.available(), fresh.reason
    assert fresh.kernel_path().parent == Path(ntcopy.__file__).parent
    assert fresh.probe() == (True, f"built: {fresh.kernel_path()}")
    _copies_exactly()
    assert not caplog.records


def test_not_built_copies_with_memcpy_and_warns_once(fresh, monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(ntcopy, "kernel_path", lambda: None)
    with caplog.at_level(logging.WARNING, logger="hpcft.store.ntcopy"):
        assert not fresh.available()
        _copies_exactly()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "not built" in warnings[0].message and "C compiler" in warnings[0].message
    assert fresh.probe()[0] is False and "reinstall" in fresh.probe()[1]


def test_unloadable_kernel_falls_back(fresh, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                      caplog: pytest.LogCaptureFixture) -> None:
    bogus = tmp_path / "_ntcopy.so"
    bogus.write_bytes(b"not an ELF file")
    monkeypatch.setattr(ntcopy, "kernel_path", lambda: bogus)
    with caplog.at_level(logging.WARNING, logger="hpcft.store.ntcopy"):
        assert not fresh.available() and "cannot be loaded" in fresh.reason
        _copies_exactly()
    assert len(caplog.records) == 1


def test_switched_off(fresh, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("HPCFT_NTCOPY", "0")
    assert not fresh.available() and "HPCFT_NTCOPY" in fresh.reason
    _copies_exactly()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # chosen on purpose: no warning


def test_strided_and_mismatched() -> None:
    src = np.arange(200, dtype=np.uint8)
    dst = np.zeros(200, dtype=np.uint8)
    ntcopy.copy(dst[::2], src[::2])  # not contiguous: numpy's copy
    assert np.array_equal(dst[::2], src[::2]) and not dst[1::2].any()
    with pytest.raises(ValueError, match="100 bytes into 99"):
        ntcopy.copy(dst[:99], src[:100])


@pytest.mark.parametrize("kernel", ntcopy.KERNELS)
@pytest.mark.parametrize("to_slot", [True, False])
def test_the_chunk_loop_copies_and_checksums_as_the_crc32c_package_with_every_kernel(kernel: str,
                                                                                      to_slot: bool) -> None:
    """hpcft_copy_chunks, both directions and every kernel: padding between and after segments checksummed from the
    slot, segments copied whole, each chunk's crc sealed with the key (checksum.seal) or left raw."""
    from hpcft.snapshot import plan
    from hpcft.store import seal

    make = ntcopy.chunk_copy(kernel)
    if make is None:
        pytest.skip(f"no C copy loop here: {ntcopy.reason or 'the CPU lacks SSE4.2/AVX2'}")
    rng = np.random.default_rng(3)
    sizes = [5, 0, 4096, 70000, 1, 3 * 32768 + 17]
    lay = plan.layout(sizes, [], 0, 1)
    grid = plan.Grid(lay.pieces, lay.nbytes, 4096)
    slot = rng.integers(0, 256, lay.nbytes, dtype=np.uint8)
    outside = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    table = grid.table()
    addr = np.array([ntcopy.address(a) for a in outside], dtype=np.uint64)[table.source.astype(np.intp)] + table.start
    for key in (None, 0xDEADBEEF):
        job = make(ntcopy.address(slot), addr, *table[2:], key, to_slot=to_slot)
        job.run()
        for i in range(grid.count):
            want = crc32c(slot[int(table.bounds[i]):int(table.bounds[i + 1])])
            assert int(job.crcs[i]) == (want if key is None else seal(want, key)), (kernel, i)
        for p in lay.pieces:
            assert np.array_equal(slot[p.offset:p.offset + p.stop - p.start], outside[p.source][p.start:p.stop])
