"""The flush's per-round agreement is an all-reduce of one vote per agent: the merge must be associative,
commutative and idempotent (the overlay's windows overlap when N is not a power of two) and give what the decision
needs from every agent (pure)."""
import itertools
import random

from hpcft.agent.protection.flush import DRAINING, FAILED, IDLE, RUNNING, combine, vote


def _votes(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [vote(i, rng.choice([IDLE, RUNNING, DRAINING, FAILED]), f"disk {i} full", rng.choice([None, "r1", "r2"]),
                 f"id{i}", rng.choice([None, 3, 7]), sorted(rng.sample(range(6), 4)), sorted(rng.sample(range(8), 5)),
                 rng.choice([0, 4, 8])) for i in range(n)]


def test_the_merge_is_associative_commutative_and_idempotent():
    for seed in range(20):
        a, b, c = _votes(3, seed)
        assert combine(a, b) == combine(b, a)
        assert combine(combine(a, b), c) == combine(a, combine(b, c))
        assert combine(a, a) == a and combine(combine(a, b), b) == combine(a, b)


def test_the_merged_vote_says_what_every_agent_said():
    votes = _votes(7, 1)
    merged = votes[0]
    for v in votes[1:]:
        merged = combine(merged, v)
    assert merged["failed"] == [[i, f"disk {i} full"] for i, v in enumerate(votes) if v["failed"]]
    assert merged["running"] == any(v["running"] for v in votes)
    assert merged["asked"] == sorted({a for v in votes for a in v["asked"]})
    assert merged["id"] == [0, "id0"]  # slot 0's flush id names the flush
    assert merged["durable"] == max((v["durable"] for v in votes if v["durable"] is not None), default=None)
    assert merged["protected"] == sorted(set.intersection(*(set(v["protected"]) for v in votes)))
    assert merged["world"] == max(v["world"] for v in votes)
    for order in itertools.islice(itertools.permutations(votes), 50):
        again = order[0]
        for v in order[1:]:
            again = combine(again, v)
        assert again == merged
