"""The supervisor's end of the nodes' reports: the report service feeding the live view, the agents' events appended by
this one writer, and `<job dir>/status.json` for `hpcft status`, replaced when the view changed (at most once a second,
less often for a large job) and at the end; nothing else is written while the job trains."""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpcft import events
from hpcft.env import AGENTS_REPORT
from hpcft.agent.transport import rendezvous, uplink, secret as job_secret
from hpcft.agent.status import FAILED, LOG, read_log
from hpcft.launch.fabric.liveview import BLIND_S, LiveView, Rounds, blind, next_write
from hpcft.launch.policy.failures import hung
from hpcft.launch.fabric.reports import ReportServer
from hpcft.store.paths import replace_file

RETRY_S = 5.0  # between tries to write the bounded log while it cannot be written (a full disk)
_log = logging.getLogger(__name__)


class Fabric:
    """One run's view of its nodes; `start` serves the reports, `env` tells the steps where, `close` ends both.
    `alarm()` is called when an agent reports that it failed or that peers are late (the supervisor looks at once, not
    at its next poll)."""

    def __init__(self, job_dir: Path, emit: Callable[..., None], clock: Callable[[], float] = time.time,
                 alarm: Callable[[], None] = lambda: None):
        self.job_dir, self.emit, self.clock, self.alarm = job_dir, emit, clock, alarm
        self.path = job_dir / LOG
        self.view = LiveView()
        self.view.load(read_log(job_dir))  # a requeued run: what the ranks had reached before
        self.rounds = Rounds()
        self.world = 0  # the trainers' world at the newest poll (`poll`): close adds the last point of the history
        self._blind_since: float | None = None  # the launch whose blind view was said
        self.server: ReportServer | None = None
        self.writes = 0  # log replacements (for tests)
        self._written = -1  # the view's version in the log
        self.unwritable: str | None = None  # why the log cannot be written now (a full disk), for the summary
        self._next = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, iface: str | None) -> None:
        """Serve the nodes' reports on this host (at `iface`'s address when it has one), event `reports_address`."""
        if self.server is not None:
            return
        secret = job_secret.load(str(job_secret.create(self.job_dir)))
        self.server = ReportServer(secret, self.take, host=",".join(rendezvous.addresses(iface)))
        self.emit("reports_address", address=self.server.address, log=str(self.path))
        self._thread = threading.Thread(target=self._write_loop, daemon=True, name="hpcft-status-log")
        self._thread.start()

    def order(self, tag: str, **asked: object) -> None:
        """Push a request to the agents of launch `tag` over their uplinks (fabric/reports.py ReportServer.order)."""
        if self.server is not None:
            self.server.order(tag, **asked)

    def env(self, with_agents: bool) -> dict[str, str]:
        """What the agents' and trainers' steps need to report here."""
        if self.server is None:
            return {}
        return {uplink.ENV: self.server.address, AGENTS_REPORT: "1" if with_agents else "0"}

    def take(self, report: dict[str, Any]) -> None:
        """One node's report into the view, its events into the job's, each round's summed (liveview.Rounds)."""
        self.view.apply(report, self.clock())
        changed = report.get("set") or {}  # the status delta: the phase when it changed, late peers when named
        if changed.get("phase") == FAILED or changed.get("late_peers"):
            self.alarm()
        tag = str(report.get("tag"))
        for record in report.get("events") or ():
            if record.get("event") == Rounds.KIND and "step" in record:
                slots = int(self.view.reports(tag).get(int(report.get("slot", -1)), {}).get("slots") or 1)
                record = self.rounds.add(tag, record, slots)
            if record is not None:
                events.append(self.job_dir, record)

    def poll(self, world: int) -> None:
        """One poll of the trainers (a world of `world` ranks): the progress history's point, if the step every rank
        has completed changed (LiveView.mark)."""
        self.world = world
        self.view.mark(world, self.clock())

    def hung(self, launched: float, hang_timeout: float, start_timeout: float) -> str | None:
        """Why the launch counts as hung (policy.hung over the view's progress), or None; None too while the view is
        blind (liveview.blind: event `progress_blind`, once), so that losing the reports is never a false hang."""
        now = self.clock()
        last = self.view.last_change(launched)
        why = hung(now, launched, last if last > launched else None, hang_timeout, start_timeout)
        if why and blind(now, launched, self.view.heard):
            if self._blind_since != launched:
                self._blind_since = launched
                self.emit("progress_blind", level=logging.WARNING, silent_s=round(now - (self.view.heard or now), 1),
                          reason=f"{why}, but no node has reported for more than {BLIND_S:g} s: the reports are lost, "
                                 "not necessarily the progress; the agents' heartbeats and the step's end decide")
            return None
        return why

    def write(self) -> bool:
        """Replace the bounded log if the view changed since it was written; True when written."""
        version = self.view.version
        if version == self._written:
            return False
        data = json.dumps(self.view.dump(self.clock()), separators=(",", ":")).encode()
        try:
            replace_file(self.path, data, self.path.with_name(f".{LOG}.{os.getpid()}"))
        except OSError as exc:  # said once, tried again every RETRY_S: supervising never depends on it
            if self.unwritable is None:
                _log.error("cannot write %s (%s): `hpcft status` shows the last view written until it can be; "
                           "tried again every %g s", self.path, exc, RETRY_S)
            self.unwritable = str(exc)
            self._next = time.monotonic() + RETRY_S
            return False
        if self.unwritable is not None:
            _log.warning("%s is written again", self.path)
            self.unwritable = None
        self._written = version
        self.writes += 1
        self._next = next_write(time.monotonic(), len(data))
        return True

    def _write_loop(self) -> None:
        while not self._stop.wait(min(0.2, max(0.05, self._next - time.monotonic()))):
            if time.monotonic() >= self._next:
                self.write()

    def close(self) -> None:
        """The run ends: the last view goes to the log (`hpcft status` after the run), the service stops."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.world:  # the last reports, read as the service closed
            self.poll(self.world)
        self.write()
