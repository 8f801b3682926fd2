"""The run's progress history, kept in the bounded log (pure): points (t, s), each saying that at wall time t (the
supervisor's clock, at the poll that first saw it) the step every rank of the trainers' world had completed (the
lowest rank's newest reported step, `LiveView.reached`) was s. A point is added only when s differs from the newest
point's: s above it is progress, s below it a roll-back (the ranks resumed from an older step); bounded by thinning."""
from __future__ import annotations

LIMIT = 2000  # points at most; when full, every other point goes: the whole run stays covered, coarser


def add(points: list[tuple[float, int]], now: float, step: int | None, limit: int = LIMIT) -> bool:
    """Append (now, step) to `points` when `step` is known and differs from the newest point's, thinned first when
    full (`thin`); True when a point was added."""
    if step is None or (points and points[-1][1] == step):
        return False
    if len(points) >= limit:
        points[:] = thin(points)
    points.append((round(now, 3), int(step)))
    return True


def thin(points: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """Every other point from the first, keeping each roll-back's two points (the step before it and the one after:
    a fault's drop survives thinning); plainly every other point should that keep more than three quarters."""
    def turn(i: int) -> bool:
        return (i > 0 and points[i][1] < points[i - 1][1]) or (i + 1 < len(points) and points[i + 1][1] < points[i][1])

    kept = [p for i, p in enumerate(points) if i % 2 == 0 or turn(i)]
    return kept if len(kept) <= 3 * len(points) // 4 else points[::2]
