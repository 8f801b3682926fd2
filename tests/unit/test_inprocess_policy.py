"""hpcft.inprocess.policy: what an in-process restart decides, over plain data."""
import pytest

from hpcft.errors import ConfigError
from hpcft.inprocess.policy import RestartOptions, barrier_outcome, describe, verdict


def test_describe_names_the_type_and_a_one_line_message() -> None:
    assert describe(RuntimeError("collective\n  timed out")) == "RuntimeError: collective timed out"
    assert describe(KeyError()) == "KeyError"


def test_a_fault_restarts_until_the_limit() -> None:
    opts = RestartOptions(max_restarts=2)
    assert verdict(RuntimeError("x"), 0, opts) is None
    assert verdict(None, 1, opts) is None  # interrupted for a peer's fault
    assert verdict(RuntimeError("x"), 2, opts) == "in-process restart limit reached (2)"


def test_fatal_exceptions_and_a_peers_give_up_are_not_restarted() -> None:
    opts = RestartOptions()
    assert "not restarted" in verdict(KeyboardInterrupt(), 0, opts)
    assert "not restarted" in verdict(ConfigError("bad"), 0, opts)  # would only repeat
    assert verdict(RuntimeError("x"), 0, opts, peer_gave_up="rank 3: limit") == "a peer gave up: rank 3: limit"


def test_the_barrier_goes_when_all_arrived_and_gives_up_on_timeout_or_a_peer() -> None:
    assert barrier_outcome(4, 4, 0.1, 10, None) == "go"
    assert barrier_outcome(3, 4, 5.0, 10, None) is None
    assert "3 of 4 ranks" in barrier_outcome(3, 4, 10.5, 10, None)
    assert barrier_outcome(2, 4, 0.1, 10, "rank 1: x") == "a peer gave up: rank 1: x"


@pytest.mark.parametrize("bad", [{"max_restarts": -1}, {"barrier_timeout_s": 0}, {"init_timeout_s": -5}])
def test_bad_options_are_named(bad: dict) -> None:
    with pytest.raises(ConfigError, match=next(iter(bad))):
        RestartOptions(**bad)
