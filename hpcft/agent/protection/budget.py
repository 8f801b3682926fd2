"""Pure policy: the agent's CPU cap under a bound on the protection lag (`lag_bound`). The budget given is the floor;
the cap rises, up to a ceiling, while the lag the next pass would leave (`foreseen_lag`) exceeds the bound, and falls
back once the lag is well within it; the wait between rounds follows the trainers' pace (`pause`)."""
from __future__ import annotations

import math
from dataclasses import dataclass

RAISE, LOWER = 2.0, 1.5  # the factors the cap moves by, one round at a time
UNMET_ROUNDS = 3  # rounds at the ceiling with the lag above the bound before that is said
LAG_STEPS = 3  # `hpcft run`'s default bound: a node lost costs at most about this many snapshots (--protect-lag)
CEILING_FACTOR, CEILING_MIN = 4.0, 1.0  # a lag bound may raise the cap to 4 budgets, and to 1 core at least


def ceiling(budget: float) -> float:
    """The most cores a lag bound may raise the agent's cap to: four times its budget, one core at least (a budget
    of a hundredth of a core, the CPU trainers', could not catch up at four hundredths)."""
    return max(CEILING_MIN, CEILING_FACTOR * budget)


def at_trainers_priority(over: bool, persisting: bool) -> bool:
    """Whether the agent competes with the trainers as their equal now, rather than below them: while they wait on it
    (a persist: drained, flushed before a requeue) or protection would trail past its bound (`over`)."""
    return over or persisting


@dataclass
class LagBudget:
    """The cap in cores for the next round, from the lag after this one (`update`)."""
    floor: float  # the budget given (cores); 0: uncapped
    ceiling: float  # the most the bound may raise the cap to (cores)
    bound: int  # protection lag in steps that the cap tries to keep to
    cap: float = 0.0
    over: int = 0  # consecutive rounds at the ceiling with the lag above the bound

    def __post_init__(self) -> None:
        self.cap = self.floor

    def update(self, lag: int | None) -> tuple[float, bool]:
        """(the cap for the next round, whether the bound is found unmeetable at the ceiling just now)."""
        if self.floor <= 0 or lag is None:  # uncapped, or nothing protected yet to measure
            return self.cap, False
        if lag > self.bound:
            self.over = self.over + 1 if self.cap >= self.ceiling else 0
            self.cap = min(self.ceiling, max(self.cap * RAISE, self.floor))
        else:
            self.over = 0
            if 2 * lag <= self.bound:
                self.cap = max(self.floor, self.cap / LOWER)
        return self.cap, self.over == UNMET_ROUNDS


def foreseen_lag(lag: int | None, per_step: float | None, round_s: float) -> int | None:
    """The lag the next pass would leave if it started now and took as long as this round (a step of margin): what
    a lag bound steers the CPU cap by, so that the cap rises before the bound is crossed, not after."""
    if lag is None:
        return None
    return lag + 1 + (math.ceil(round_s / per_step) if per_step else 0)


def pause(interval: float, bound: int | None, lag: int | None, per_step: float | None, round_s: float) -> float:
    """Seconds before the next round: the interval, or with a lag bound, short enough that the next pass (as long as
    this round) ends before the trainers stage `bound` steps past the newest protected one (a step of margin)."""
    if bound is None or per_step is None:
        return interval
    return min(interval, max(0.0, (bound - 1 - (lag or 0)) * per_step - round_s))
