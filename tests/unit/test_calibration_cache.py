"""The calibration's cache file (stale keys, corrupt or foreign files), the resolution order (HPCFT_COPY, cache,
measurement) and a real calibration at a tiny size."""
import json
import os
from pathlib import Path

import pytest

from hpcft.env import usable_cores
from hpcft.errors import ConfigError
from hpcft.snapshot import calibration
from hpcft.snapshot.calibration import cache, measure
from hpcft.snapshot.calibration.policy import CASES, Choice, Method, Sample, pick
from hpcft.store import ntcopy

M = 1 << 20
CANNED = [Sample(c, Method(k, t, M), s, 1 << 26) for c in ("snapshot", "restore", "restore_cold")
          for k, t, s in (("stream", 1, 0.02), ("memcpy", 2, 0.01))]


@pytest.fixture
def path(shm_root: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache file's path on the real /dev/shm; HPCFT_COPY cleared (the suite pins it)."""
    monkeypatch.delenv(calibration.ENV, raising=False)
    return shm_root / ".hpcft-test-copy.json"


def test_write_then_read_gives_the_samples_back(path):
    key = cache.host_key()
    cache.write(path, key, CANNED, 0.5)
    entry, why = cache.read(path, key)
    assert why == "" and entry["samples"] == CANNED and entry["seconds"] == 0.5
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_an_entry_of_another_host_or_kernel_build_is_stale(path):
    key = cache.host_key()
    cache.write(path, {**key, "os_kernel": "an older build"}, CANNED, 0.5)
    entry, why = cache.read(path, key)
    assert entry is None and "no measurement for this host as it is now" in why
    # a new entry joins the file beside the other key's
    cache.write(path, key, CANNED[:3], 0.4)
    assert len(json.loads(path.read_text())["entries"]) == 2
    assert cache.read(path, key)[0]["samples"] == CANNED[:3]


@pytest.mark.parametrize("content", ["{not json", "[]", json.dumps({"format": 0, "entries": []}),
                                     json.dumps({"format": cache.FORMAT, "entries": "x"})])
def test_a_corrupt_file_is_not_trusted(path, content):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, content.encode())
    os.close(fd)
    entry, why = cache.read(path, cache.host_key())
    assert entry is None and "unusable" in why


def test_a_corrupt_entry_for_this_host_is_not_trusted(path):
    key = cache.host_key()
    cache.write(path, key, CANNED, 0.5)
    data = json.loads(path.read_text())
    data["entries"][0]["samples"][0]["threads"] = -1
    path.write_text(json.dumps(data))
    entry, why = cache.read(path, key)
    assert entry is None and "threads -1" in why


def test_a_file_others_could_have_written_is_refused(path):
    cache.write(path, cache.host_key(), CANNED, 0.5)
    os.chmod(path, 0o644)
    entry, why = cache.read(path, cache.host_key())
    assert entry is None and "mode 0600" in why
    os.unlink(path)
    os.symlink(path.with_name("elsewhere"), path)
    entry, why = cache.read(path, cache.host_key())
    assert entry is None and "symlink" in why


def test_a_cached_measurement_is_used_without_measuring(path):
    cache.write(path, cache.host_key(), CANNED, 0.5)
    got = calibration.resolve(2, environ={}, path=path)
    assert got.source == "cache" and str(path) in got.detail
    assert got.choice == pick(CANNED, got.choice) == Choice(Method("memcpy", 2, M), Method("memcpy", 2, M))


def test_the_override_wins_over_the_cache(path):
    cache.write(path, cache.host_key(), CANNED, 0.5)
    got = calibration.resolve(2, environ={calibration.ENV: "stream,threads=1"}, path=path)
    assert got.source == "override" and got.choice.snapshot == Method("stream", 1, M)
    got = calibration.resolve(3, environ={calibration.ENV: "default"}, path=path)
    assert got.source == "override" and got.choice.restore.threads == 3
    with pytest.raises(ConfigError, match="HPCFT_COPY"):
        calibration.resolve(2, environ={calibration.ENV: "threads=many"}, path=path)


def test_doctor_never_measures(path):
    got = calibration.resolve(2, environ={}, path=path, measure_now=False)
    assert got.source == "default" and "not calibrated yet" in got.detail and not path.exists()


def test_a_corrupt_cache_is_measured_again_and_replaced(path):
    """A real calibration (under two seconds is the design; not asserted: the machine is shared)."""
    path.write_text("garbage")
    os.chmod(path, 0o600)
    got = calibration.resolve(2, environ={}, path=path, force=False)
    assert got.source == "measured" and "unusable" in got.detail and f"cached in {path}" in got.detail
    entry, why = cache.read(path, cache.host_key())
    assert why == "" and entry["samples"] == list(got.samples)
    assert calibration.resolve(2, environ={}, path=path) is got  # remembered by the process


def test_a_real_calibration_at_a_tiny_size(shm_root):
    counts = measure.thread_counts(usable_cores())
    samples = measure.measure(shm_root, usable_cores(), nbytes=4 << 20, chunks=(256 << 10, M), repeats=1)
    cases = {c for cs in CASES.values() for c in cs}
    kernels = ntcopy.kernels()
    first = {(s.case, s.method.kernel, s.method.threads) for s in samples if s.method.chunk_bytes == M}
    assert first >= {(c, k, t) for c in cases for k in kernels for t in counts}
    assert {s.case for s in samples if s.method.chunk_bytes == 256 << 10} == cases
    assert all(s.seconds and s.seconds > 0 for s in samples if s.method.kernel in kernels)
    assert not list(shm_root.iterdir())  # the scratch file was unlinked at once
    choice = pick(samples, Choice(Method("memcpy", 1, M), Method("memcpy", 1, M)))
    assert choice.snapshot.chunk_bytes == choice.restore.chunk_bytes in (256 << 10, M)


def test_thread_counts_cover_one_to_the_cores():
    assert measure.thread_counts(1) == [1]
    assert measure.thread_counts(2) == [1, 2]
    assert measure.thread_counts(7) == [1, 2, 4, 7]
    assert measure.thread_counts(64) == [1, 2, 4, 8, 16]


def test_device_backends_keep_their_own_copy_logic():
    s = calibration.settings("torch", 4)
    assert s.resolved is None and s.snapshot.threads == s.restore.threads == 4 and s.snapshot.chunk_bytes == 0
    assert calibration.settings("hip", 4, threads=6, chunk_bytes=8 << 20).snapshot == Method("stream", 6, 8 << 20)
