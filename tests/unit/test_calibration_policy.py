"""The copy-method policy over canned measurements, and the HPCFT_COPY override's grammar."""
import pytest

from hpcft.errors import ConfigError
from hpcft.snapshot.calibration.policy import (DEFAULT_CHUNK, MARGIN, Choice, Method, Sample, default_choice,
                                               parse_override, pick)

N = 1 << 26
M = DEFAULT_CHUNK
FALLBACK = default_choice(2, "stream")


def grid(times: dict[tuple[str, str, int, int], float | None]) -> list[Sample]:
    """Samples from {(case, kernel, threads, chunk): seconds}."""
    return [Sample(case, Method(k, t, c), s, N, "" if s else "kernel not built") for (case, k, t, c), s in times.items()]


def both(kernel: str, threads: int, chunk: int, snap: float, rest: float, cold: float | None = None) -> dict:
    return {("snapshot", kernel, threads, chunk): snap, ("restore", kernel, threads, chunk): rest,
            ("restore_cold", kernel, threads, chunk): rest if cold is None else cold}


def test_the_fastest_method_of_each_direction_is_chosen():
    samples = grid({**both("stream", 1, M, 10.0, 10.0), **both("stream", 2, M, 6.0, 9.0),
                    **both("memcpy", 1, M, 9.0, 5.0), **both("memcpy", 2, M, 8.0, 7.0)})
    assert pick(samples, FALLBACK) == Choice(Method("stream", 2, M), Method("memcpy", 1, M))


def test_a_difference_within_the_noise_margin_goes_to_the_cheaper_method():
    # two threads 3 % faster than one: noise, and a second thread costs a core
    faster = 1 - MARGIN * 0.6
    samples = grid({**both("stream", 1, M, 1.0, 1.0), **both("stream", 2, M, faster, faster),
                    **both("memcpy", 1, M, faster, faster)})
    assert pick(samples, FALLBACK) == Choice(Method("stream", 1, M), Method("stream", 1, M))
    # beyond the margin it wins
    samples = grid({**both("stream", 1, M, 1.0, 1.0), **both("stream", 2, M, 0.8, 0.8)})
    assert pick(samples, FALLBACK).snapshot.threads == 2


def test_an_exact_tie_prefers_fewer_threads_then_the_streaming_kernel():
    samples = grid({**both("memcpy", 1, M, 1.0, 1.0), **both("stream", 1, M, 1.0, 1.0), **both("stream", 2, M, 1.0, 1.0)})
    assert pick(samples, FALLBACK) == Choice(Method("stream", 1, M), Method("stream", 1, M))


def test_a_method_that_failed_its_probe_is_never_chosen():
    samples = grid({**both("stream", 2, M, None, None), **both("memcpy", 2, M, 4.0, 4.0), **both("memcpy", 1, M, 6.0, 6.0)})
    assert pick(samples, FALLBACK) == Choice(Method("memcpy", 2, M), Method("memcpy", 2, M))


def test_nothing_usable_measured_gives_the_fallback():
    assert pick([], FALLBACK) == FALLBACK
    assert pick(grid(both("stream", 1, M, None, None)), FALLBACK) == FALLBACK
    # a restore measured warm only (its cold case missing) is not a measured restore
    assert pick(grid({("snapshot", "stream", 1, M): 1.0, ("restore", "stream", 1, M): 1.0}), FALLBACK) == FALLBACK


def test_the_restore_weighs_the_cold_case_as_much_as_the_warm_one():
    # memcpy wins warm by a little but loses cold by a lot
    samples = grid({**both("stream", 1, M, 1.0, 1.0, cold=2.0), **both("memcpy", 1, M, 1.0, 0.9, cold=3.0)})
    assert pick(samples, FALLBACK).restore.kernel == "stream"


def test_the_chunk_size_is_one_for_both_directions_chosen_on_their_sum():
    small, large = 256 << 10, 4 << 20
    samples = grid({**both("stream", 2, M, 1.0, 1.0), **both("stream", 2, small, 0.7, 1.6),
                    **both("stream", 1, large, 0.9, 0.8)})
    got = pick(samples, FALLBACK)
    # sums per chunk (snapshot + warm + cold restore): M 3.0, 256 KiB 3.9, 4 MiB 2.5
    assert got.snapshot.chunk_bytes == got.restore.chunk_bytes == large
    assert got.snapshot == Method("stream", 1, large)


def test_chunk_sizes_within_the_margin_keep_the_default_size():
    samples = grid({**both("stream", 2, M, 1.0, 1.0), **both("stream", 2, 4 << 20, 0.99, 0.99)})
    assert pick(samples, FALLBACK).snapshot.chunk_bytes == M


def test_samples_measured_on_different_sizes_compare_per_byte():
    samples = [Sample("snapshot", Method("stream", 1, M), 1.0, N), Sample("snapshot", Method("stream", 2, M), 1.0, 2 * N)]
    samples += [Sample(c, Method("stream", 1, M), 1.0, N) for c in ("restore", "restore_cold")]
    samples += [Sample(c, Method("stream", 2, M), 1.0, N) for c in ("restore", "restore_cold")]
    assert pick(samples, FALLBACK).snapshot.threads == 2


def test_sample_round_trip_and_refusals():
    s = Sample("restore_cold", Method("memcpy", 3, 4 << 20), 0.25, N)
    assert Sample.from_dict(s.as_dict()) == s
    assert Sample.from_dict({**s.as_dict(), "seconds": None}).seconds is None
    for bad in ({"kernel": "avx"}, {"threads": 0}, {"threads": True}, {"chunk_bytes": "1M"}, {"seconds": -1.0},
                {"seconds": float("nan")}, {"case": "flush"}, {"nbytes": None}):
        with pytest.raises(ValueError):
            Sample.from_dict({**s.as_dict(), **bad})


def test_override_pins_both_directions_or_one():
    base = default_choice(2, "stream")
    assert parse_override("memcpy", base) == Choice(Method("memcpy", 2, M), Method("memcpy", 2, M))
    assert parse_override("stream, threads=3, chunk=256K", base) == Choice(Method("stream", 3, 256 << 10),
                                                                           Method("stream", 3, 256 << 10))
    got = parse_override("snapshot.threads=1,restore.kernel=memcpy,chunk=4MiB", base)
    assert got == Choice(Method("stream", 1, 4 << 20), Method("memcpy", 2, 4 << 20))
    assert parse_override("chunk=2097152", base).restore.chunk_bytes == 2 << 20


@pytest.mark.parametrize("text, names", [
    ("avx512", "kernel 'avx512'"), ("threads=0", "threads '0'"), ("threads=two", "threads 'two'"),
    ("chunk=1G", "'1G' is not a size"), ("chunk=1K", "chunk must be between"), ("restore.chunk=1M", "one for both"),
    ("agent.threads=2", "not a setting"), ("speed=9", "not a setting")])
def test_override_errors_name_the_part_and_the_fix(text, names):
    with pytest.raises(ConfigError) as err:
        parse_override(text, default_choice(2, "stream"))
    fix = "write chunk=1M" if "chunk=1M" in text else "HPCFT_COPY=stream,threads=2"
    assert names in str(err.value) and fix in str(err.value)
