"""When the supervisor asks Slurm about its nodes while the trainers run (pure, the clock passed in): on a slow timer
(--slurm-check-every, so that an admin's drain is seen), at once on suspicion (srun said an error, a node's reports
went silent), then every SUSPECT_EVERY_S while the suspicion lasts (SUSPECT_FOR_S: Slurm marks a dead node only after
its SlurmdTimeout). The primary signals are the job's own: the step's exit and the agents' heartbeats (probed)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

TROUBLE_WORDS = ("error", "abort", "fail", "cancel", "terminat")  # in an srun line: a sign a node may be lost
SUSPECT_EVERY_S = 2.0  # while a suspicion lasts: Slurm asked this often
SUSPECT_FOR_S = 60.0  # how long a suspicion lasts after its last sign


@dataclass
class SlurmLooks:
    """`due(now)`: why Slurm is to be asked now ('timer', 'suspicion: …') or None; `looked(now)` once it was;
    `suspect(now, why)` on a sign of trouble. `period`: the slow timer, from the last look."""

    period: float
    last: float = 0.0  # when Slurm was last asked (at launch: the launch's own look)
    suspicion: str = ""  # the newest sign of trouble, '' when none lasts
    _fresh: bool = False  # a sign not yet answered by a look
    _until: float = 0.0  # when the suspicion ends without a new sign

    def suspect(self, now: float, why: str) -> None:
        """A sign of trouble: Slurm is asked at the next poll, then every SUSPECT_EVERY_S for SUSPECT_FOR_S."""
        self.suspicion, self._fresh, self._until = why, True, now + SUSPECT_FOR_S

    def due(self, now: float) -> str | None:
        """Why Slurm is to be asked now, or None."""
        if self.suspicion and now >= self._until:
            self.suspicion = ""
        if self.suspicion and (self._fresh or now >= self.last + SUSPECT_EVERY_S):
            return f"suspicion: {self.suspicion}"
        return "timer" if now >= self.last + self.period else None

    def looked(self, now: float) -> None:
        """Slurm was asked now (by this policy's due look, at launch or at a decision)."""
        self.last, self._fresh = now, False


def srun_trouble(lines: Sequence[str]) -> str | None:
    """srun's first line of trouble among `lines` of a step's stderr (its tasks' own lines are passed over): an error,
    an aborted step, a node failure; None when there is none."""
    return next((line.strip()[:200] for line in lines if line.startswith("srun: ")
                 and any(word in line.lower() for word in TROUBLE_WORDS)), None)
