"""The streaming-store copy kernel: the same bytes as numpy for any size and alignment, the source's crc32c,
and numpy copies where no kernel can be built or it is switched off."""
from pathlib import Path

import numpy as np
import pytest

from hpcft.snapshot import ntcopy
from hpcft.store import crc32c


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """ntcopy as on first use in a new process, building into an empty per-test cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(ntcopy, "_tried", False)
    monkeypatch.setattr(ntcopy, "_lib", None)
    return ntcopy


def _copies_exactly() -> None:
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    for n in (0, 1, 31, 33, 4095, 4096, 4097, 70000, 1 << 19):
        for a, b in ((0, 0), (1, 0), (0, 7), (13, 45)):
            dst = np.full(n + 128, 0xAB, dtype=np.uint8)
            assert ntcopy.copy_crc(dst[b:b + n], src[a:a + n], 7) == crc32c(src[a:a + n], 7)
            assert np.array_equal(dst[b:b + n], src[a:a + n])
            assert (dst[:b] == 0xAB).all() and (dst[b + n:] == 0xAB).all()  # nothing outside written


def test_kernel_builds_and_copies_exactly(fresh) -> None:
    if not fresh.available():
        pytest.skip(f"no streaming-store kernel here: {fresh.reason}")
    built = list((fresh._cache_dir()).glob("ntcopy-*.so"))
    assert len(built) == 1 and not built[0].stat().st_mode & 0o022
    _copies_exactly()


def test_without_a_compiler_numpy_copies(fresh, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "/bin/false")
    assert not fresh.available() and "false" in fresh.reason
    _copies_exactly()


def test_switched_off(fresh, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPCFT_NTCOPY", "0")
    assert not fresh.available() and "HPCFT_NTCOPY" in fresh.reason
    _copies_exactly()


def test_strided_and_mismatched() -> None:
    src = np.arange(200, dtype=np.uint8)
    dst = np.zeros(200, dtype=np.uint8)
    ntcopy.copy(dst[::2], src[::2])  # not contiguous: numpy's copy
    assert np.array_equal(dst[::2], src[::2]) and not dst[1::2].any()
    with pytest.raises(ValueError, match="100 bytes into 99"):
        ntcopy.copy(dst[:99], src[:100])
