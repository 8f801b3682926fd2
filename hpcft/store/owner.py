"""Whose snapshot is it: a restore takes only the versions its own job wrote, unless told to adopt another job's
(`adopt=`, $HPCFT_ADOPT, exported by `hpcft run --adopt JOB`). `stranger` decides for every path that picks a version;
the durable tier, a directory the user names for later jobs too, is read across jobs (and says so)."""
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from hpcft import events

ENV_ADOPT = "HPCFT_ADOPT"


@dataclass(frozen=True)
class Owner:
    """The job a restore is for: its id; this process's writer id where that id is the shared default (any local
    run may have written that store, so only this process's versions are the run's own); the job it adopts."""
    job_id: str
    writer: str | None = None
    adopt: str | None = None


@dataclass(frozen=True)
class Stranger:
    """A version that is not its restorer's own: whose it is, and whether a restore takes it (`why`)."""
    job: str
    writer: str | None
    taken: bool
    why: str


def adoption(given: str | None = None, environ: Mapping[str, str] | None = None) -> str | None:
    """The job whose versions a restore takes besides its own: `given`, else $HPCFT_ADOPT, else None."""
    value = given if given is not None else (os.environ if environ is None else environ).get(ENV_ADOPT)
    value = str(value).strip() if value is not None else ""
    return value or None


def stranger(meta: Mapping[str, Any], owner: Owner, *, durable: bool = False) -> Stranger | None:
    """None when `meta` (a manifest, a durable checkpoint's meta) is `owner`'s; else whose it is and whether a restore
    takes it (adopted, or `durable`). A field the meta does not record (written by hand) is not checked."""
    job, writer = meta.get("job_id"), meta.get("writer")
    writer = None if writer is None else str(writer)
    if job is None or str(job) == owner.job_id and (owner.writer is None or writer in (None, owner.writer)):
        return None
    job = str(job)
    if job == owner.adopt:
        return Stranger(job, writer, True, f"adopted: adopt={job} was given")
    who = "another process with the shared default job id" if job == owner.job_id else f"job {job}"
    if durable:
        return Stranger(job, writer, True, f"a durable checkpoint of {who}: the durable tier is a directory the user "
                                           "names, read by later jobs too")
    return Stranger(job, writer, False, f"written by {who}")


def refuse(found: Iterable[tuple[int, Mapping[str, Any]]], owner: Owner, **where: Any) -> set[int]:
    """The steps of `found` ((step, manifest) pairs) holding a version a restore must not take, with an event
    `restore_foreign` per job they belong to (`where`: rank or slot, path). Nothing is removed."""
    steps: dict[str, set[int]] = {}
    writers: dict[str, set[str]] = {}
    for step, meta in found:
        s = stranger(meta, owner)
        if s is not None and not s.taken:
            steps.setdefault(s.job, set()).add(step)
            writers.setdefault(s.job, set()).update([s.writer] if s.writer else [])
    for job, held in sorted(steps.items()):
        listed = ",".join(map(str, sorted(held)))
        events.emit("restore_foreign", level=logging.ERROR, **where, job=job, steps=listed, own_job=owner.job_id,
                    writers=",".join(sorted(writers[job])), advice=_advice(job, listed, owner))
    return set().union(*steps.values())


def _advice(job: str, steps: str, owner: Owner) -> str:
    if job == owner.job_id:  # the shared default id: another process's run
        return (f"step(s) {steps} were written by another process with the default job id {job!r}, which every run "
                "outside a launcher shares: not loaded, left in place; give each run its own job id (job_id= or "
                f"HPCFT_JOB_ID), or take them with adopt={job!r} (HPCFT_ADOPT={job})")
    return (f"step(s) {steps} belong to job {job}, not to this job {owner.job_id}: not loaded, left in place; to "
            f"resume from them pass --adopt {job} to hpcft run (outside it: adopt={job!r} or HPCFT_ADOPT={job})")
