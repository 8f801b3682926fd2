"""Which of a job's nodes are bad: Slurm's view (scontrol, read fresh) and, when asked, a probe (a trivial task on
each node at once; a node that does not answer within --probe-timeout is bad). Mechanism only: the supervisor
decides when to look and what a bad node means."""
from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future

from hpcft.errors import SlurmError
from hpcft.launch.policy.failures import probe_deadline
from hpcft.launch.node.srun import probe_argv
from hpcft.slurm import state as slurmstate
from hpcft.slurm.runner import Runner

_log = logging.getLogger(__name__)
SLURM_EVERY_S = 1.0  # while probes are pending: Slurm's view of their nodes this often
UNLAUNCHED_FACTOR = 3.0  # a probe whose step the controller has not created yet waits this × --probe-timeout


class NodeCheck:
    """`bad(nodes, probe=…)`: {node: why} of the bad ones among `nodes`, each with a `node_bad` event."""

    def __init__(self, runner: Runner, job_id: str, environ: Mapping[str, str], probe_timeout: float,
                 emit: Callable[..., None]):
        self.runner, self.job_id, self.environ = runner, job_id, environ
        self.probe_timeout, self.emit = probe_timeout, emit
        self._closed: dict[str, str] = {}  # {node: state} of the closed nodes last said
        self.closed_now: dict[str, str] = {}  # the closed nodes the last check found (bad ones or not)

    def bad(self, nodes: Sequence[str], *, probe: bool, closed: bool = True, found_by: str | None = None,
            suspected: Mapping[str, str] | None = None, controls: Sequence[str] = (),
            until: Callable[[], bool] | None = None, allocation: bool = True,
            ahead: Future | None = None) -> dict[str, str]:
        """Slurm's bad nodes among `nodes`; with `probe` and none lost, those that fail the probe (beside `controls`).
        `closed`: a node Slurm gives no new work counts as bad, as a launch needs; without, it is only said
        (`node_closed`) and its step goes on. `found_by` and `suspected` go into the events; `until`: see `probe`;
        `allocation`: the job's node list is read too (without: `scontrol show node` alone, for the slow timer);
        `ahead`: a probe of (at least) these nodes started before (`probe_ahead`), its verdict (its controls' too)
        awaited in place of a new probe where it found one of them bad (where they answered then, they are probed
        again)."""
        try:
            health = slurmstate.node_health(self.runner, self.job_id, list(nodes), allocation=allocation)
        except SlurmError as exc:
            _log.warning("node check failed: %s", exc)
            health = slurmstate.Health({}, {})
        self.closed_now = dict(health.closed)
        if not closed:
            self._say_closed(health.closed)
        bad = dict(health.bad if closed else health.lost)
        rest = [n for n in nodes if n not in bad]
        if probe and not health.lost and rest:  # a closed node may hide a dead one: the others are probed still
            found = {n: f"{why} (probed ahead)" for n, why in (ahead.result() if ahead else {}).items()}
            bad.update(found if set(found) & set(rest) else self.probe(rest, controls, closed=closed, until=until))
        for node, why in bad.items():
            self.emit("node_bad", level=logging.WARNING, node=node, state=why,
                      **({"found_by": found_by} if found_by else {}),
                      **({"suspected": suspected[node]} if suspected and node in suspected else {}))
        return bad

    def _say_closed(self, closed: Mapping[str, str]) -> None:
        """One `node_closed` event per node and state: an admin's drain or `scontrol reboot ASAP` of a running node
        is no failure (it answers, its memory holds the snapshots), but the run's log must show why it is left."""
        for node, state in closed.items():
            if self._closed.get(node) != state:
                self.emit("node_closed", level=logging.WARNING, node=node, state=state,
                          action="kept: its tasks and agent keep running; after a failure a spare takes its slot "
                                 "if one is left, and Slurm leaves it out of the next allocation")
        self._closed = dict(closed)

    def probe(self, nodes: Sequence[str], controls: Sequence[str] = (), *, closed: bool = True,
              until: Callable[[], bool] | None = None) -> dict[str, str]:
        """Run a trivial task on each node and control at once; a node is bad that does not answer within
        --probe-timeout of srun sending it the task or, once half the controls answered, `probe_deadline` (a control
        still silent once every suspect is judged is left unjudged). Before srun sent it (`--verbose`),
        the slow one is the controller: that counts only past UNLAUNCHED_FACTOR × --probe-timeout (a failed srun is
        restarted). A node Slurm marks bad meanwhile is bad at once; `until()` ends the probe (a better-informed check
        is due)."""
        controls = [c for c in controls if c not in nodes]
        started = time.monotonic()
        pending = {n: self._start(n) for n in [*nodes, *controls]}
        again: dict[str, _Probe] = {}  # node: its ended probe, whose srun gave up on the controller (started again)
        answered: dict[str, float] = {}  # control: seconds from its launch to its answer
        ask_slurm = started + SLURM_EVERY_S
        bad: dict[str, str] = {}
        unlaunched = UNLAUNCHED_FACTOR * self.probe_timeout
        while pending or again:
            now = time.monotonic()
            if until is not None and until():
                for node, p in pending.items():
                    p.end(now, node, kill=True)
                return bad
            for node in [n for n, p in again.items() if now >= p.began + SLURM_EVERY_S]:
                pending[node] = self._start(node)
                del again[node]
            for node, p in list(pending.items()):
                if p.proc.poll() is None:
                    p.read(now, node)
                    continue
                out = p.end(now, node)
                del pending[node]
                if p.proc.returncode != 0 and p.launched is None and now - started < unlaunched:  # srun gave up
                    # before asking the node (the controller timed out, or was not there): the node is not judged yet
                    _log.info("probe of %s: srun ended before launching its task (%s); again", node, p.error())
                    again[node] = p
                    continue
                if p.proc.returncode != 0 or out.strip() != node:
                    bad[node] = f"probe failed (exit status {p.proc.returncode}{p.error(': ')})"
                if node in controls:
                    answered[node] = now - (p.launched or started)
            # half the controls answered time a healthy answer: a second lost node among them (a switch, a rack) must
            # not hold the suspects' verdict for --probe-timeout
            timed = list(answered.values()) if controls and 2 * len(answered) >= len(controls) else None
            waited = probe_deadline(self.probe_timeout, timed)
            overdue = {n: f"probe did not answer within {waited:.3g} s" + (
                           "" if timed is None else f" (--probe-timeout {self.probe_timeout:g} s; {len(timed)} other "
                                                    f"node(s) answered within {max(timed):.2f} s)")
                       for n, p in pending.items() if p.launched is not None and now - p.launched >= waited
                       and (timed is None or n not in controls)}
            overdue.update({n: f"Slurm did not launch the probe's task within {unlaunched:.3g} s "
                               f"({UNLAUNCHED_FACTOR:g} × --probe-timeout {self.probe_timeout:g} s{p.error('; ')})"
                            for n, p in {**pending, **again}.items()
                            if p.launched is None and now - started >= unlaunched})
            rest = [n for n in [*pending, *again] if n not in overdue]
            marked = {**(self._slurm_marked(rest, closed) if rest and now >= ask_slurm else {}), **overdue}
            if now >= ask_slurm:
                ask_slurm = now + SLURM_EVERY_S
            for node, why in marked.items():
                if node in pending:
                    pending.pop(node).end(now, node, kill=True)
                again.pop(node, None)
                bad[node] = why
            if timed is not None and all(n in controls for n in [*pending, *again]):  # every suspect judged
                for node, p in pending.items():  # a control still silent times nothing: not judged here (the
                    p.end(now, node, kill=True)  # agents name it, or the next launch's check finds it)
                    _log.info("probe of control %s: no answer by the suspects' verdict; not judged", node)
                return bad
            time.sleep(0.05 if pending or again else 0)
        return bad

    def probe_ahead(self, nodes: Sequence[str], controls: Sequence[str] = ()) -> Future:
        """`probe(nodes, controls)` on a thread of its own: its {node: why}, for a `bad(…, ahead=)` to come."""
        verdict: Future = Future()

        def run() -> None:
            try:
                found = self.probe(nodes, controls)
            except Exception as exc:  # (srun missing, say) no verdict: the nodes are probed when named lost
                _log.warning("probe ahead of %s failed: %s", ",".join(nodes), exc)
                found = {}
            verdict.set_result(found)

        threading.Thread(target=run, name="hpcft-probe-ahead", daemon=True).start()
        return verdict

    def _start(self, node: str) -> _Probe:
        """The probe's srun on `node`."""
        return _Probe(self.runner.popen(probe_argv([node]), env=dict(self.environ), stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE))

    def _slurm_marked(self, nodes: list[str], closed: bool) -> dict[str, str]:
        try:
            health = slurmstate.node_health(self.runner, self.job_id, nodes)
            return {n: f"{why} (Slurm, while the probe waited)"
                    for n, why in (health.bad if closed else health.lost).items()}
        except SlurmError as exc:
            _log.warning("node check failed: %s", exc)
            return {}


class _Probe:
    """A node's probe: its srun, its stderr so far (read without blocking), when srun sent the task (None: not yet)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.began = proc, time.monotonic()
        self.said = b""
        self.launched: float | None = None
        os.set_blocking(proc.stderr.fileno(), False)

    def read(self, now: float, node: str) -> None:
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(self.proc.stderr.fileno(), 65536):
                self.said += chunk
        if self.launched is None and node in slurmstate.launched_on(self.said.decode(errors="replace")):
            self.launched = now

    def end(self, now: float, node: str, kill: bool = False) -> str:
        """Its stdout, once its srun ended (`kill`: killed now); what it said read to the end, its pipes closed."""
        if kill:
            self.proc.kill()
        self.proc.wait()
        self.read(now, node)
        out = self.proc.stdout.read() if self.proc.stdout else ""
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream:
                stream.close()
        return out.decode(errors="replace") if isinstance(out, bytes) else out

    def error(self, prefix: str = "") -> str:
        """srun's last error line, after `prefix`; '' when it said none."""
        lines = [ln for ln in self.said.decode(errors="replace").splitlines() if "error" in ln.lower()]
        return f"{prefix}{lines[-1].strip()[:200]}" if lines else ""
