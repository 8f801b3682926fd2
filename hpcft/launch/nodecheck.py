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
        """Run a trivial task on each node at once; a node that does not answer in time is bad."""
        procs = {n: self.runner.popen(probe_argv([n]), env=dict(self.environ), stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True) for n in nodes}
        deadline = time.monotonic() + self.probe_timeout
        bad = {}
        for node, p in procs.items():
            try:
                out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
                if p.returncode != 0 or out.strip() != node:
                    bad[node] = f"probe failed (exit status {p.returncode})"
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
                bad[node] = f"probe did not answer within {self.probe_timeout:g} s"
        return bad


def describe(bad: Mapping[str, str]) -> str:
    """`node: why; node: why` of bad nodes, for an event's detail."""
    return "; ".join(f"{n}: {w}" for n, w in bad.items())
