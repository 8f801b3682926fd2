"""Which of a job's nodes are bad: Slurm's view (scontrol, read fresh) and, when asked, a probe (a trivial task on
each node at once; a node that does not answer within --probe-timeout is bad). Mechanism only: the supervisor
decides when to look and what a bad node means."""
from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence

from hpcft.errors import SlurmError
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

    def bad(self, nodes: Sequence[str], *, probe: bool, found_by: str | None = None,
            suspected: Mapping[str, str] | None = None) -> dict[str, str]:
        """Slurm's bad nodes among `nodes`; with `probe` and none found, those that fail the probe. `found_by`
        (e.g. what made the supervisor look) and `suspected` ({node: what made it a suspect}) go into the events."""
        try:
            bad = slurmstate.bad_nodes(self.runner, self.job_id, list(nodes))
        except SlurmError as exc:
            _log.warning("node check failed: %s", exc)
            bad = {}
        if probe and not bad:
            bad = self.probe(nodes)
        for node, why in bad.items():
            self.emit("node_bad", level=logging.WARNING, node=node, state=why,
                      **({"found_by": found_by} if found_by else {}),
                      **({"suspected": suspected[node]} if suspected and node in suspected else {}))
        return bad

    def probe(self, nodes: Sequence[str]) -> dict[str, str]:
        """Run a trivial task on each node at once; a node that does not answer in time is bad. Slurm stays a second
        source meanwhile: a node it marks bad while its probe is pending is bad at once (a frozen node's probe only
        ends at --probe-timeout)."""
        pending = {n: self.runner.popen(probe_argv([n]), env=dict(self.environ), stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, text=True) for n in nodes}
        deadline = time.monotonic() + self.probe_timeout
        ask_slurm = time.monotonic() + SLURM_EVERY_S
        bad: dict[str, str] = {}
        while pending:
            for node, p in list(pending.items()):
                if p.poll() is not None:
                    out, _ = p.communicate()
                    if p.returncode != 0 or out.strip() != node:
                        bad[node] = f"probe failed (exit status {p.returncode})"
                    del pending[node]
            now = time.monotonic()
            marked = {n: f"probe did not answer within {self.probe_timeout:g} s" for n in pending} \
                if now >= deadline else self._slurm_marked(list(pending)) if pending and now >= ask_slurm else {}
            if now >= ask_slurm:
                ask_slurm = now + SLURM_EVERY_S
            for node, why in marked.items():
                pending[node].kill()
                pending.pop(node).communicate()
                bad[node] = why
            time.sleep(0.05 if pending else 0)
        return bad

    def _slurm_marked(self, nodes: list[str]) -> dict[str, str]:
        try:
            return {n: f"{why} (Slurm, while the probe waited)"
                    for n, why in slurmstate.bad_nodes(self.runner, self.job_id, nodes).items()}
        except SlurmError as exc:
            _log.warning("node check failed: %s", exc)
            return {}
