"""Which of a job's nodes are bad: Slurm's view (scontrol, read fresh) and, when asked, a probe (a trivial task on
each node at once; a node that does not answer within --probe-timeout is bad). Mechanism only: the supervisor
decides when to look and what a bad node means."""
from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence

from hpcft.errors import SlurmError
from hpcft.launch.policy import probe_deadline
from hpcft.launch.srun import probe_argv
from hpcft.slurm import state as slurmstate
from hpcft.slurm.runner import Runner

_log = logging.getLogger(__name__)
SLURM_EVERY_S = 1.0  # while probes are pending: Slurm's view of their nodes this often


class NodeCheck:
    """`bad(nodes, probe=…)`: {node: why} of the bad ones among `nodes`, each with a `node_bad` event."""

    def __init__(self, runner: Runner, job_id: str, environ: Mapping[str, str], probe_timeout: float,
                 emit: Callable[..., None]):
        self.runner, self.job_id, self.environ = runner, job_id, environ
        self.probe_timeout, self.emit = probe_timeout, emit
        self._closed: dict[str, str] = {}  # {node: state} of the closed nodes last said
        self.closed_now: dict[str, str] = {}  # the closed nodes the last check found (bad ones or not)

    def bad(self, nodes: Sequence[str], *, probe: bool, closed: bool = True, found_by: str | None = None,
            suspected: Mapping[str, str] | None = None, controls: Sequence[str] = ()) -> dict[str, str]:
        """Slurm's bad nodes among `nodes`; with `probe` and none lost, those that fail the probe (probed beside
        `controls`, which time a healthy answer: `probe`). `closed`: a node Slurm gives no new work (drained, a
        reboot asked for) counts as bad, as it must when a launch is to be made; without, it is only said (one
        `node_closed` event) and the step that runs on it goes on. `found_by` (e.g. what made the supervisor look)
        and `suspected` ({node: what made it a suspect}) go into the events."""
        try:
            health = slurmstate.node_health(self.runner, self.job_id, list(nodes))
        except SlurmError as exc:
            _log.warning("node check failed: %s", exc)
            health = slurmstate.Health({}, {})
        self.closed_now = dict(health.closed)
        if not closed:
            self._say_closed(health.closed)
        bad = dict(health.bad if closed else health.lost)
        rest = [n for n in nodes if n not in bad]
        if probe and not health.lost and rest:  # a closed node may hide a dead one: the others are probed still
            bad.update(self.probe(rest, controls, closed=closed))
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

    def probe(self, nodes: Sequence[str], controls: Sequence[str] = (), *, closed: bool = True) -> dict[str, str]:
        """Run a trivial task on each node (and each of `controls`) at once; a node that does not answer in time is
        bad: within --probe-timeout, or, once every control has answered, within a few times their slowest answer
        (policy.probe_deadline: a frozen node is named in seconds, not at the timeout). Slurm stays a second source
        meanwhile: a node it marks bad (`closed`: or closed) while its probe is pending is bad at once."""
        controls = [c for c in controls if c not in nodes]
        started = time.monotonic()
        pending = {n: self.runner.popen(probe_argv([n]), env=dict(self.environ), stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, text=True) for n in [*nodes, *controls]}
        answered: dict[str, float] = {}  # control: seconds to its answer
        ask_slurm = started + SLURM_EVERY_S
        bad: dict[str, str] = {}
        while pending:
            for node, p in list(pending.items()):
                if p.poll() is not None:
                    out, _ = p.communicate()
                    if p.returncode != 0 or out.strip() != node:
                        bad[node] = f"probe failed (exit status {p.returncode})"
                    if node in controls:
                        answered[node] = time.monotonic() - started
                    del pending[node]
            now = time.monotonic()
            timed = [answered[c] for c in controls] if controls and len(answered) == len(controls) else None
            waited = probe_deadline(self.probe_timeout, timed)
            late = f"probe did not answer within {waited:.3g} s" + (
                "" if timed is None else f" (--probe-timeout {self.probe_timeout:g} s; {len(timed)} other node(s) "
                                         f"answered within {max(timed):.2f} s)")
            marked = {n: late for n in pending} if now - started >= waited else \
                self._slurm_marked(list(pending), closed) if pending and now >= ask_slurm else {}
            if now >= ask_slurm:
                ask_slurm = now + SLURM_EVERY_S
            for node, why in marked.items():
                pending[node].kill()
                pending.pop(node).communicate()
                bad[node] = why
            time.sleep(0.05 if pending else 0)
        return bad

    def _slurm_marked(self, nodes: list[str], closed: bool) -> dict[str, str]:
        try:
            health = slurmstate.node_health(self.runner, self.job_id, nodes)
            return {n: f"{why} (Slurm, while the probe waited)"
                    for n, why in (health.bad if closed else health.lost).items()}
        except SlurmError as exc:
            _log.warning("node check failed: %s", exc)
            return {}
