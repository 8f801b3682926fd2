"""Erasure codes and stripes: every tolerated loss pattern rebuilds byte-identically; one more is refused."""
import itertools

import numpy as np
import pytest

from hpcft.agent.protection.codec import RsCodec, Unrecoverable, XorCodec, XorFold, codec_for, xor_into
from hpcft.agent.protection.placement import Scheme, plan
from hpcft.agent.protection.stripes import encode_paced, encode_set, partner_copies, rebuild_partner, rebuild_set
from hpcft.errors import ConfigError

RNG = np.random.default_rng(7)


def _payloads(sizes):
    return [RNG.integers(0, 256, n, dtype=np.uint8) for n in sizes]


def _patterns(n, upto):
    return [c for r in range(1, upto + 1) for c in itertools.combinations(range(n), r)]


@pytest.mark.parametrize("scheme,sizes", [
    (Scheme("xor", group=4), [1000, 1003, 999, 1]),
    (Scheme("xor", group=3), [4096, 4096, 4096]),
    (Scheme("rs", group=4, losses=2), [1000, 1003, 7, 640]),
    (Scheme("rs", group=6, losses=3), [333] * 6),
])
def test_every_tolerated_loss_rebuilds_byte_identical(scheme, sizes):
    pset = plan(len(sizes), scheme).sets[0]
    codec = codec_for(scheme.name, pset.size, pset.losses)
    payloads = _payloads(sizes)
    parities = encode_set(pset, payloads, codec)
    for lost in _patterns(pset.size, pset.losses):
        got, par = rebuild_set(pset, [None if i in lost else p for i, p in enumerate(payloads)],
                               [None if i in lost else p for i, p in enumerate(parities)], sizes, codec)
        for a, b in zip(got + par, payloads + parities):
            assert a.tobytes() == b.tobytes(), lost


@pytest.mark.parametrize("scheme", [Scheme("xor", group=4), Scheme("rs", group=5, losses=2)])
def test_one_loss_too_many_is_refused(scheme):
    pset = plan(scheme.group, scheme).sets[0]
    codec = codec_for(scheme.name, pset.size, pset.losses)
    sizes = [500] * pset.size
    payloads = _payloads(sizes)
    parities = encode_set(pset, payloads, codec)
    for lost in itertools.combinations(range(pset.size), pset.losses + 1):
        with pytest.raises(Unrecoverable, match=f"tolerates {pset.losses}"):
            rebuild_set(pset, [None if i in lost else p for i, p in enumerate(payloads)],
                        [None if i in lost else p for i, p in enumerate(parities)], sizes, codec)


def test_a_lost_parity_block_alone_is_recomputed():
    pset = plan(4, Scheme("xor", group=4)).sets[0]
    codec = XorCodec(4)
    payloads = _payloads([800] * 4)
    parities = encode_set(pset, payloads, codec)
    _, par = rebuild_set(pset, payloads, [None, *parities[1:]], [800] * 4, codec)
    assert par[0].tobytes() == parities[0].tobytes()


def test_partner_rebuilds_a_lost_node_and_refuses_a_lost_pair():
    placement = plan(4, Scheme("partner", distance=1))
    payloads = _payloads([100, 200, 300, 400])
    copies = partner_copies(placement, payloads)
    for lost in range(4):
        got, held = rebuild_partner(placement, [None if i == lost else p for i, p in enumerate(payloads)],
                                    [None if i == lost else c for i, c in enumerate(copies)])
        assert [g.tobytes() for g in got + held] == [p.tobytes() for p in payloads + copies]
    with pytest.raises(Unrecoverable, match="both lost"):
        rebuild_partner(placement, [None, None, *payloads[2:]], [None, None, *copies[2:]])


def test_xor_into_is_in_place_and_rs_matches_its_own_decode():
    a, b, c = _payloads([1 << 20] * 3)
    out = np.empty_like(a)
    xor_into(out, [a, b, c])
    assert (out == (a ^ b ^ c)).all()
    rs = RsCodec(4, 2)
    p = [np.empty_like(a), np.empty_like(a)]
    rs.encode([a, b], p)
    got = {0: np.empty_like(a), 1: np.empty_like(a)}
    rs.decode({2: p[0], 3: p[1]}, got)
    assert got[0].tobytes() == a.tobytes() and got[1].tobytes() == b.tobytes()


def _padded(x, n):
    out = np.zeros(n, dtype=np.uint8)
    out[:x.size] = x
    return out


def test_short_sources_count_as_zero_padded_without_copies():
    n = 3 * 1000 + 17
    srcs = _payloads([n, n - 5, 1000, 0])
    out = np.full(n, 0xAB, dtype=np.uint8)  # stale bytes must not survive
    xor_into(out, srcs, chunk=1000)
    want = np.zeros(n, dtype=np.uint8)
    for s in srcs:
        want ^= _padded(s, n)
    assert out.tobytes() == want.tobytes()
    rs, full = RsCodec(4, 2, chunk=1000), [_padded(s, n) for s in srcs[:2]]
    short, padded = [np.empty(n, np.uint8), np.empty(n, np.uint8)], [np.empty(n, np.uint8), np.empty(n, np.uint8)]
    rs.encode([srcs[0], srcs[2]], short)
    rs.encode([full[0], _padded(srcs[2], n)], padded)
    assert [p.tobytes() for p in short] == [p.tobytes() for p in padded]


def test_fold_builds_the_parity_from_pieces_arriving_in_any_order_and_length():
    n, grid = 2500, 512
    pieces = _payloads([n, n - 700, 300])
    out = np.full(n, 0x5A, dtype=np.uint8)
    fold = XorFold(out, grid=grid)
    parts = [(i, off, p[off:off + grid]) for i, p in enumerate(pieces) for off in range(0, p.size, grid)]
    for _, off, data in reversed(parts):  # the last piece's chunks first, interleaved senders
        fold.add(off, data)
    fold.finish()
    want = np.zeros(n, dtype=np.uint8)
    for p in pieces:
        want ^= _padded(p, n)
    assert out.tobytes() == want.tobytes()
    with pytest.raises(ConfigError, match="grid"):
        fold.add(100, pieces[0][:10])


def test_paced_rs_encode_equals_one_call_and_paces_every_slice():
    """The agent encodes RS parity in column slices with its CPU cap checked before each: same bytes as one
    call, short data blocks still zero-padded, one pace per slice."""
    rng = np.random.default_rng(5)
    codec = RsCodec(4, 2)
    data = [rng.integers(0, 256, n, dtype=np.uint8) for n in (10_000, 6_001)]  # the second is short
    for t in (0, 1):
        want = np.empty(10_000, dtype=np.uint8)
        codec.encode_some(data, {t: want})
        got, paced = np.empty(10_000, dtype=np.uint8), []
        encode_paced(codec, data, t, got, lambda: paced.append(1), slice_bytes=1024)
        assert np.array_equal(got, want) and len(paced) == 10
