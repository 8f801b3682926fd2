"""What one `hpcft run` owes its summary and its next run: state.json (kept even on a full disk, said once), why each
launch happens, the progress lost, the shrinks and grows, how the previous run ended; the summary built from them."""
import logging
from pathlib import Path
from typing import Callable

from hpcft import events
from hpcft.launch import losses
from hpcft.launch.fabric.service import Fabric
from hpcft.launch.policy.failures import Action, Decision, Event
from hpcft.launch.policy.layout import Layout
from hpcft.launch.policy.state import NAME as STATE, RunState


class Ledger:
    """The run's account, kept by the supervisor: `lost` (each loss counted once by losses.loss), `reshaped` (each
    elastic shrink and grow), `previous` (a previous run that lost its batch host), `reached` (the step the trainers
    had reached when their last launch ended), `why_launch` (the reason a loss caused by the next launch carries)."""

    def __init__(self, job_dir: Path, emit: Callable[..., None], fabric: Fabric):
        self.job_dir, self.emit, self.fabric = job_dir, emit, fabric
        self.path = job_dir / STATE
        self.lost: list[losses.Loss] = []
        self.reshaped: dict[str, list[str]] = {"shrunk": [], "grown": []}
        self.previous: losses.PreviousRun | None = None
        self.supervisors: list[str] = []  # a successor's: the lost supervisor's node, then its own
        self.reached: int | None = None
        self.why_launch = "first launch"
        self._state_unwritten: str | None = None  # why state.json could not be written last (a full disk)

    def load(self) -> RunState:
        return RunState.load(self.path)

    def save(self, saved: RunState) -> None:
        """state.json for the next run. A job directory that cannot take it (a full disk) costs this run nothing:
        said once (ERROR `state_unwritten`) and in the summary; a requeued run would read the state written last."""
        try:
            saved.save(self.path)
        except OSError as exc:
            if self._state_unwritten is None:
                self.emit("state_unwritten", level=logging.ERROR, path=str(self.path), error=str(exc),
                          consequence="a requeued run reads the state written last: the restarts, requeues and "
                                      "excluded nodes since then are not known to it")
            self._state_unwritten = str(exc)
        else:
            self._state_unwritten = None

    def previous_run(self, layout: Layout, requeues: int, generation: int = 0) -> None:
        """What this run takes over: the step the trainers had reached (a requeued run's or a successor's view comes
        from the log the previous supervisor left) and, when that one was lost with its node, that, said at once
        (`previous_run`)."""
        self.reached = self.fabric.view.reached(layout.world_size)
        if not requeues and not generation:
            return
        self.why_launch = f"supervisor generation {generation}" if generation else f"requeued run {requeues}"
        self.previous = losses.PreviousRun.lost_batch_host(events.read(self.job_dir), self.reached)
        if self.previous is not None:
            self.why_launch += f": {self.previous.what()}"
            self.emit("previous_run", level=logging.WARNING, node=self.previous.node, state=self.previous.state,
                      reached=self.reached, reason=self.previous.reason())

    def decided(self, decision: Decision, event: Event, protect: str) -> None:
        """Why the next launch happens, and what it could lose (with `protect`, the run's scheme)."""
        self.why_launch = decision.reason
        if event.bad_nodes and protect == "none":
            self.why_launch += f"; nothing protected the lost node's snapshots (--protect {protect})"

    def summary(self, action: Action, reason: str, saved: RunState, exit_code: int | None,
                watched: dict[str, str]) -> None:
        """The run's last word: its end, each loss, a lost batch host (ERROR if it gave up or restarted from 0), and
        what the watches add (`watched`: evictions, protection stalls)."""
        from_zero = any(loss.resumed_from == 0 for loss in self.lost)
        inproc = sum(e["event"] == "inprocess_restart" and e.get("rank") == 0 for e in events.read(self.job_dir))
        unwritten = self.unwritten()
        level = (logging.ERROR if action is Action.STOP or from_zero
                 else logging.WARNING if self.lost or any(self.reshaped.values()) or watched or inproc
                 or action is Action.REQUEUE or unwritten or self.previous
                 else logging.INFO)
        self.emit("summary", level=level, action=action.value, reason=reason, restarts=saved.restarts,
                  requeues=saved.requeues, excluded=",".join(saved.excluded), exit_code=exit_code,
                  lost="; ".join(loss.line() for loss in self.lost), steps_lost=losses.steps_lost(self.lost),
                  inprocess_restarts=inproc,  # the ranks' own (restartable)
                  **({"previous_run": self.previous.summary()} if self.previous else {}),
                  **({"supervised_by": ",".join(self.supervisors)} if self.supervisors else {}),
                  **{key: "; ".join(lines) for key, lines in self.reshaped.items() if lines},
                  **watched, **({"unwritten": unwritten} if unwritten else {}))

    def unwritten(self) -> str:
        """What the run could not write to its job directory (a full disk, a quota): its events and status log."""
        said = [f"{len(u.lines) + u.dropped} event(s) not in {u.path} ({u.error}; they are in this output)"
                for u in events.unwritten()]
        if self.fabric.unwritable:
            said.append(f"{self.fabric.path} not updated ({self.fabric.unwritable})")
        if self._state_unwritten:
            said.append(f"{self.path} not updated ({self._state_unwritten})")
        return "; ".join(said)
