"""The node agent's protection loop: agree with the other agents on the newest step every node holds
and not yet protected, check it, protect it. No state of its own: everything is read from the store."""
from __future__ import annotations

import logging
from pathlib import Path

from hpcft import events
from hpcft.agent.bundle import Bundle, complete_steps
from hpcft.agent.mesh import Mesh
from hpcft.agent.placement import Placement
from hpcft.agent.protect import Record, protect_step, records
from hpcft.errors import IntegrityError


def _common(lists: list[list[int]]) -> set[int]:
    return set.intersection(*(set(x) for x in lists)) if lists else set()


def protect_newest(mesh: Mesh, placement: Placement, job: Path, keep: int = 2) -> Record | None:
    """One collective round: protect the newest step complete on every node and not yet protected
    everywhere; None if there is none, or if a node found its copy damaged (with an event)."""
    complete = complete_steps(job)
    held = mesh.allgather(sorted(complete))
    done = mesh.allgather(sorted(records(job)))
    todo = sorted(_common(held) - _common(done))
    if not todo:
        return None
    step = todo[-1]
    bundle = Bundle(step, complete[step])
    try:
        try:
            bundle.verify()
            ok = True
        except IntegrityError as exc:
            events.emit("protect_skipped", level=logging.ERROR, step=step, slot=mesh.slot, reason=str(exc))
            ok = False
        if not all(mesh.allgather(ok)):
            return None
        return protect_step(mesh, placement, bundle, job, keep)
    finally:
        bundle.close()
