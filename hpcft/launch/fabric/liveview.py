"""The supervisor's newest view of the job from the nodes' reports, in memory (pure: time passed in): each agent's
status per launch tag, each rank's newest step, its `ready_s` and when it changed, and the run's progress history
(fabric/history.py). `dump` is the bounded log `<job dir>/status.json`, `load` reads it back (a requeued run)."""
from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from hpcft.agent.status import STOPPED, TERMINAL
from hpcft.agent.transport.uplink import KEEPALIVE_S, patch
from hpcft.launch.fabric import history

KEEP_TAGS = 8  # launches whose agents' statuses are kept (the log stays bounded across many relaunches)
LOG_MIN_S = 1.0  # the bounded log is replaced at most once a second …
LOG_BYTES_PER_S = 1 << 20  # … and at most this many bytes a second on average (a large job's log, less often)
BLIND_S = 3 * KEEPALIVE_S  # no report from any node for this long: the view is lost, not the job's progress


def blind(now: float, launched: float, heard: float | None, within: float = BLIND_S) -> bool:
    """Whether the view has gone blind during the launch: nodes reported since it began, then none for `within`
    seconds (every reporter died or lost its connection). The hang watchdog then waits for the agents' heartbeats'
    verdict (steps/agentloss.py) instead of calling a hang; a launch never heard from is judged as before."""
    return heard is not None and heard >= launched and now - heard > within


def next_write(last: float, size: int, min_s: float = LOG_MIN_S, rate: float = LOG_BYTES_PER_S) -> float:
    """When the bounded log may be written again, after a write of `size` bytes at `last`."""
    return last + max(min_s, size / rate)


class LiveView:
    """See module doc; thread-safe (the report service's thread applies, the supervisor's reads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._agents: dict[str, dict[int, dict[str, Any]]] = {}  # tag -> slot -> status
        self._progress: dict[int, tuple[int, float | None, float]] = {}  # rank -> (step, ready_s, changed at)
        self.version = 0  # moves with every change (the log is written only when it moved)
        self.heard: float | None = None  # when the newest report (an empty one included) arrived
        self._heard_from: dict[int, float] = {}  # slot -> when its node's newest report arrived
        self._ended: set[str] = set()  # launches whose agents the supervisor has seen end (`ended`)
        self._history: list[tuple[float, int]] = []  # (time, the step every rank had completed): history.py

    def apply(self, msg: Mapping[str, Any], now: float) -> None:
        """One node's report (`Uplink._message`): its status delta, its ranks' progress."""
        with self._lock:
            self.heard = now
            if isinstance(msg.get("slot"), int):
                self._heard_from[msg["slot"]] = now
            if "set" in msg:
                tag, slot = str(msg["tag"]), int(msg["slot"])
                slots = self._agents.setdefault(tag, {})
                base = {} if msg.get("full") else slots.get(slot, {})
                new = patch(base, msg["set"], list(msg.get("drop") or ()))
                if tag in self._ended and new.get("phase") not in TERMINAL:  # a report read after the step ended
                    new["phase"] = slots.get(slot, {}).get("phase", new.get("phase"))
                slots[slot] = new
                for old in list(self._agents)[:-KEEP_TAGS]:
                    del self._agents[old]
            for rank, (step, ready) in (msg.get("progress") or {}).items():
                r = int(rank)
                before = self._progress.get(r)
                # a step the view already holds (a relaunch's agents report the store's last one) is no progress
                changed = now if before is None or before[0] != step else before[2]
                self._progress[r] = (int(step), None if ready is None else float(ready), changed)
            self.version += 1

    def ended(self, tag: str, how: str) -> list[int]:
        """The supervisor stopped launch `tag`'s agents (`how`: asked, killed): each slot whose last report is not
        terminal (killed before saying `stopped`, or that report lost) is marked `stopped` by the supervisor, for good
        against later reports of the launch; the slots so marked."""
        with self._lock:
            self._ended.add(tag)
            marked = []
            for slot, report in self._agents.get(tag, {}).items():
                if report.get("phase") not in TERMINAL:
                    report.update(phase=STOPPED, stopped_by="supervisor", how=how, last_phase=report.get("phase"))
                    marked.append(slot)
            self.version += bool(marked)
            return marked

    def forget(self, tag: str) -> None:
        """Drop the statuses of launch `tag` (a launch reusing a tag must not see the old agents' reports)."""
        with self._lock:
            self._ended.discard(tag)
            if self._agents.pop(tag, None) is not None:
                self.version += 1

    def reports(self, tag: str | None = None) -> dict[int, dict[str, Any]]:
        """{slot: status} of the agents of launch `tag`, or the newest per slot when None (agent/status.py `read`)."""
        with self._lock:
            if tag is not None:
                return {s: dict(v) for s, v in self._agents.get(tag, {}).items()}
            out: dict[int, dict[str, Any]] = {}
            for slots in self._agents.values():
                for s, v in slots.items():
                    if s not in out or v.get("time", 0) > out[s].get("time", 0):
                        out[s] = dict(v)
            return out

    def silent(self, slots: int, now: float, since: float, within: float = BLIND_S) -> list[int]:
        """Those of slots 0 … slots-1 whose node reported at or after `since` (a launch), then nothing for `within` s
        (each node reports at least every KEEPALIVE_S): a sign to ask Slurm. A slot not heard yet is not judged."""
        with self._lock:
            return [s for s in range(slots) if since <= self._heard_from.get(s, -1.0) < now - within]

    def samples(self) -> dict[int, tuple[int, float | None, float]]:
        """{rank: (step, ready_s or None, when the supervisor saw the step change)}."""
        with self._lock:
            return dict(self._progress)

    def steps(self) -> dict[int, tuple[int, float]]:
        """{rank: (step, when it changed)}."""
        return {r: (s, t) for r, (s, _, t) in self.samples().items()}

    def last_change(self, since: float) -> float:
        """The time of the newest progress after `since`, or `since` if there is none."""
        return max((t for _, (_, _, t) in self.samples().items() if t > since), default=since)

    def reached(self, world: int) -> int | None:
        """The newest step every one of `world` ranks has reported, or None while a rank has reported none."""
        return _lowest(self.samples(), world)

    def mark(self, world: int, now: float) -> bool:
        """One poll of the trainers' world of `world` ranks: the progress of ranks beyond it (a shrunk job's) goes, and
        the history gets a point when the step every rank has completed changed (history.add); True if it did."""
        with self._lock:
            for rank in [r for r in self._progress if r >= world] if len(self._progress) > world else ():
                del self._progress[rank]
            added = history.add(self._history, now, _lowest(self._progress, world))
            self.version += added
            return added

    def dump(self, now: float) -> dict[str, Any]:
        """The bounded log's content: every kept launch's agents, every rank's progress, the progress history."""
        with self._lock:
            return {"time": now, "version": self.version,
                    "agents": {tag: {str(s): v for s, v in slots.items()} for tag, slots in self._agents.items()},
                    "progress": {str(r): list(p) for r, p in sorted(self._progress.items())},
                    "history": [list(p) for p in self._history]}

    def load(self, log: Mapping[str, Any]) -> None:
        """What an earlier run's log said (a requeued run's lost-progress accounting starts from it)."""
        with self._lock:
            for tag, slots in (log.get("agents") or {}).items():
                self._agents[str(tag)] = {int(s): dict(v) for s, v in slots.items()}
            for rank, (step, ready, changed) in (log.get("progress") or {}).items():
                self._progress[int(rank)] = (int(step), ready, float(changed))
            self._history = [(float(t), int(s)) for t, s in log.get("history") or ()]
            self.version += 1


def _lowest(progress: Mapping[int, tuple[int, float | None, float]], world: int) -> int | None:
    """The lowest step of ranks 0 … world-1 in `progress`, or None while one of them has reported none."""
    held = [progress[r][0] for r in range(world) if r in progress]
    return min(held) if world and len(held) == world else None


class Rounds:
    """The agents' per-round event (`snapshot_protected`, one per agent per protected step) summed into one record
    per step once every agent of the launch has sent its own, so that the job's events file grows by one line per
    protected step, not one per node. Steps older than a summed one are dropped (a set lost a member meanwhile)."""

    KIND = "snapshot_protected"

    def __init__(self) -> None:
        self._open: dict[tuple[str, int], list[dict]] = {}

    def add(self, tag: str, record: Mapping[str, Any], slots: int) -> dict[str, Any] | None:
        """The summed record once `slots` agents of launch `tag` have protected the record's step, else None."""
        step = int(record["step"])
        got = self._open.setdefault((tag, step), [])
        got.append(dict(record))
        if len(got) < slots:
            return None
        self._open = {k: v for k, v in self._open.items() if k[0] != tag or k[1] > step}
        return {"event": self.KIND, "time": max(r.get("time", 0) for r in got), "level": "INFO", "tag": tag,
                "step": step, "slots": len(got), "scheme": got[0].get("scheme"),
                "held_bytes": sum(r.get("held_bytes") or 0 for r in got),
                "sent_bytes": sum(r.get("sent_bytes") or 0 for r in got),
                "seconds": max(r.get("seconds") or 0 for r in got)}
