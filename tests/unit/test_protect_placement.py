"""Placement of protection data: sets of G slots, parity rotation (RAID-5 style), partners, domains."""
import itertools

import pytest

from hpcft.agent.protection.placement import Scheme, plan, spread
from hpcft.errors import ConfigError


@pytest.mark.parametrize("slots,group,sizes", [(4, 4, [4]), (8, 4, [4, 4]), (6, 4, [6]), (9, 4, [5, 4]),
                                               (13, 3, [4, 3, 3, 3])])
def test_sets_cover_every_slot_once_with_at_least_g_members(slots, group, sizes):
    p = plan(slots, Scheme("xor", group=group))
    assert [s.size for s in p.sets] == sizes
    members = [m for s in p.sets for m in s.members]
    assert sorted(members) == list(range(slots))
    assert all(p.set_of(m).index == s.index for s in p.sets for m in s.members)


@pytest.mark.parametrize("group,losses", [(4, 1), (4, 2), (5, 2), (6, 3)])
def test_every_member_holds_k_parity_blocks_and_gives_g_minus_k_pieces(group, losses):
    pset = plan(group, Scheme("rs" if losses > 1 else "xor", group=group, losses=losses)).sets[0]
    for pos in range(group):
        assert len(pset.stripes_holding(pos)) == losses
        fed = [s for s in range(group) if pos in pset.data_positions(s)]
        assert len(fed) == group - losses
        assert sorted(pset.piece_of(pos, s) for s in fed) == list(range(group - losses))
    for s in range(group):
        assert sorted(pset.parity_positions(s) + pset.data_positions(s)) == list(range(group))


def test_extra_memory_per_scheme():
    assert Scheme("xor", group=4).stored_over_state() == pytest.approx(1 / 3)
    assert Scheme("rs", group=4, losses=2).stored_over_state() == pytest.approx(1.0)
    assert Scheme("partner").stored_over_state() == 1.0
    assert Scheme("none").stored_over_state() == 0.0


def test_partner_at_distance_is_another_node_and_inverts():
    p = plan(4, Scheme("partner", distance=2))
    assert [p.partner_of(s) for s in range(4)] == [2, 3, 0, 1]
    assert all(p.partnered_by(p.partner_of(s)) == s for s in range(4))
    with pytest.raises(ConfigError, match="different node"):
        plan(4, Scheme("partner", distance=4))


def test_spread_interleaves_failure_domains():
    nodes = [f"n{i}" for i in range(1, 9)]
    racks = {n: "A" if i < 4 else "B" for i, n in enumerate(nodes)}
    order = spread(nodes, racks)
    assert order == ["n1", "n5", "n2", "n6", "n3", "n7", "n4", "n8"]
    p = plan(len(order), Scheme("xor", group=2))
    for s in p.sets:
        assert len({racks[order[m]] for m in s.members}) == 2
    assert spread(nodes) == nodes


def test_bad_configurations_are_named():
    with pytest.raises(ConfigError, match="unknown protection scheme 'raid6'"):
        Scheme("raid6")
    with pytest.raises(ConfigError, match="xor tolerates exactly one"):
        Scheme("xor", losses=2)
    with pytest.raises(ConfigError, match="1 <= losses < group"):
        Scheme("rs", group=2, losses=2)
    with pytest.raises(ConfigError, match="needs at least 4 nodes"):
        plan(3, Scheme("xor", group=4))
    with pytest.raises(ConfigError, match="more than once"):
        spread(["n1", "n2", "n1"])


def test_no_two_members_of_a_set_share_a_node():
    order = spread([f"n{i}" for i in range(12)])
    for scheme in (Scheme("xor", group=4), Scheme("rs", group=5, losses=2)):
        for s in plan(len(order), scheme).sets:
            assert len({order[m] for m in s.members}) == s.size
            assert not any(a == b for a, b in itertools.combinations(s.members, 2))
