"""What `hpcft run` keeps in <job dir>/state.json for the job's next run (a relaunch counts, a requeued run reads it
back): relaunches, requeues, grows and evictions so far, the nodes found bad, each slot's node, what Slurm excluded."""
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from hpcft.errors import ConfigError
from hpcft.launch.policy.failures import Action

NAME = "state.json"  # in the job directory


@dataclass
class RunState:
    """What the next allocation must know: the counts, the nodes found bad, each slot's node (holding its snapshots)."""
    restarts: int = 0
    requeues: int = 0
    excluded: list[str] = field(default_factory=list)
    slots: list[str] = field(default_factory=list)
    slurm_excluded: list[str] = field(default_factory=list)  # what Slurm took into the job's ExcNodeList
    grows: int = 0  # launches of an elastic grow (no restarts: --max-restarts counts failures)
    evictions: int = 0  # launches after a straggler's eviction (no restarts either)

    @property
    def launches(self) -> int:
        """Launches before the next one (its tag: keeps the launches' agents, reports and logs apart)."""
        return self.restarts + self.requeues + self.grows + self.evictions

    def count(self, action: Action) -> None:
        """Count the launch `action` leads to: a grow or an eviction is no restart (--max-restarts counts failures)."""
        if action is Action.GROW:
            self.grows += 1
        elif action is Action.EVICT:
            self.evictions += 1
        else:
            self.restarts += 1

    @classmethod
    def load(cls, path: Path) -> "RunState":
        if not path.exists():
            return cls()
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return cls(int(data["restarts"]), int(data.get("requeues", 0)), list(data.get("excluded", [])),
                       list(data.get("slots", [])), list(data.get("slurm_excluded", [])), int(data.get("grows", 0)),
                       int(data.get("evictions", 0)))
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path} is not a valid supervisor state ({exc}); move it away to start afresh") from None

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.__dict__), encoding="utf-8")
        os.replace(tmp, path)
