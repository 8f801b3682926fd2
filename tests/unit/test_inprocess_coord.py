"""hpcft.inprocess.coord against a real TCPStore: the completion barrier tells a finished peer from a faulted one."""
import socket

from hpcft.inprocess.coord import Coord


def test_a_rank_that_sees_the_last_rank_finish_between_its_checks_finishes_too() -> None:
    """The race a loaded CI box hit: this rank read 1 of 2 done, then the peer finished and made `f/0` exist to wake
    the watchers; this rank took that key for a fault and waited 60 s for a fault record nobody wrote."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    me = Coord("127.0.0.1", port, 0, 2, timeout_s=10)
    real = me.faulted

    def peer_finishes_first(gen: int) -> bool:  # what the other rank's finish() does, all of it, right here
        me.store.add(f"d/{gen}", 1)
        me.store.add(f"f/{gen}", 0)
        me.store.add(f"d/{gen}/left", 1)
        return real(gen)

    me.faulted = peer_finishes_first
    assert me.finish(0, timeout_s=5) is True
