"""What an in-process restart decides, as pure functions over plain data: whether a fault may be restarted in
process, how a fault is named in events, and how long a rank waits for its peers at the restart barrier."""
from __future__ import annotations

from dataclasses import dataclass

from hpcft.errors import ConfigError

# Exceptions that end the process on purpose, or would only repeat (bad input): never restarted in process.
FATAL = (KeyboardInterrupt, SystemExit, MemoryError, ConfigError)


@dataclass(frozen=True)
class RestartOptions:
    """How `hpcft.restartable` restarts (docs/reference/checkpointing.md "In-process restart")."""
    max_restarts: int = 3  # in this process's life; one more fault gives up (exit non-zero: the supervisor relaunches)
    barrier_timeout_s: float = 60.0  # a rank's wait at the restart barrier for the others (a dead rank never arrives)
    init_timeout_s: float = 600.0  # the process groups' timeout: a collective blocked this long raises, restarted

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ConfigError(f"max_restarts must be 0 or more (got {self.max_restarts})")
        for name in ("barrier_timeout_s", "init_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive (got {getattr(self, name)})")


def describe(exc: BaseException) -> str:
    """`Type: message` of an exception, on one line and short enough for an event."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


def verdict(exc: BaseException | None, restarts: int, opts: RestartOptions,
            peer_gave_up: str | None = None) -> str | None:
    """Why this fault cannot be restarted in process (the give-up reason), or None to restart. `exc` is this rank's
    own exception (None: interrupted for a peer's fault); `restarts` counts the restarts already made."""
    if peer_gave_up:
        return f"a peer gave up: {peer_gave_up}"
    if exc is not None and isinstance(exc, FATAL):
        return f"{type(exc).__name__} is not restarted in process"
    if restarts >= opts.max_restarts:
        return f"in-process restart limit reached ({opts.max_restarts})"
    return None


def barrier_outcome(arrived: int, world: int, waited_s: float, timeout_s: float, gave_up: str | None) -> str | None:
    """At the restart barrier: "go" when every rank arrived, the reason to give up (a peer did, or the timeout
    passed: a rank died), or None to keep waiting."""
    if gave_up:
        return f"a peer gave up: {gave_up}"
    if arrived >= world:
        return "go"
    if waited_s > timeout_s:
        return f"only {arrived} of {world} ranks reached the restart barrier within {timeout_s:g} s (a rank died?)"
    return None
