"""The pure planning functions: balanced DP shares, contiguous layouts, chunks that cover every byte once."""
import random

import pytest

from hpcft.snapshot import plan


@pytest.mark.parametrize("total,members", [(0, 3), (10, 4), (1 << 20, 3), (12345, 7), (64, 1)])
def test_share_cuts_balanced(total: int, members: int) -> None:
    cuts = plan.share_cuts(total, members)
    sizes = [b - a for a, b in zip(cuts, cuts[1:])]
    assert cuts[0] == 0 and cuts[-1] == total and all(s >= 0 for s in sizes) and len(sizes) == members
    assert max(sizes) - min(sizes) <= 2 * plan.ALIGN + 1  # each cut is within ALIGN of the ideal one
    assert all(c % plan.ALIGN == 0 for c in cuts[1:-1])


def test_shares_partition_the_replicated_bytes() -> None:
    rng = random.Random(3)
    sizes = [rng.choice([0, 4, 8, 100, 4096, 70000]) for _ in range(40)]
    members = 3
    seen = [bytearray(n) for n in sizes]
    for m in range(members):
        lay = plan.layout([], sizes, m, members)
        for p in lay.pieces:
            for i in range(p.start, p.stop):
                seen[p.source][i] += 1
    assert all(all(b == 1 for b in s) for s in seen)


def test_chunks_cover_each_piece_byte_once() -> None:
    own = [3, 100, 0, 5000, 64]
    rep = [1000, 2000, 7]
    lay = plan.layout(own, rep, 1, 2)
    covered: dict[int, bytearray] = {i: bytearray(n) for i, n in enumerate(own + rep)}
    last = 0
    for c in plan.chunks(lay.pieces, lay.nbytes, 512):
        assert c.offset == last and 0 < c.nbytes <= 512
        last = c.offset + c.nbytes
        for s in c.segments:
            assert c.offset <= s.offset and s.offset + s.nbytes <= c.offset + c.nbytes
            for i in range(s.start, s.start + s.nbytes):
                covered[s.source][i] += 1
    assert last == lay.nbytes
    lo, hi = lay.share_range
    for i, n in enumerate(own):
        assert all(b == 1 for b in covered[i])
    shared = sum(sum(covered[len(own) + j]) for j in range(len(rep)))
    assert shared == hi - lo


def test_offsets_aligned_and_disjoint() -> None:
    lay = plan.layout([1, 2, 3, 100], [], 0, 1)
    offs = [p.offset for p in lay.pieces]
    assert all(o % plan.ALIGN == 0 for o in offs) and offs == sorted(set(offs))


def test_rep_cuts_fall_on_element_boundaries() -> None:
    """Mixed element sizes (bf16 weights, fp32 step counters) put tensors at odd stream offsets; every cut still
    lands on an element boundary of the tensor it falls in, and the shares still partition the stream."""
    rng = random.Random(5)
    for _ in range(200):
        grains = [rng.choice([1, 2, 4, 8]) for _ in range(rng.randint(1, 12))]
        sizes = [g * rng.randint(0, 300) for g in grains]
        members = rng.randint(1, 6)
        cuts = plan.rep_cuts(sizes, members, grains)
        assert cuts[0] == 0 and cuts[-1] == sum(sizes) and cuts == sorted(cuts) and len(cuts) == members + 1
        starts = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        for c in cuts:
            i = next((i for i in range(len(sizes)) if starts[i] <= c < starts[i + 1]), None)
            assert i is None or (c - starts[i]) % grains[i] == 0
