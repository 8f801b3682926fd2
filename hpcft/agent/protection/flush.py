"""The agents' flush to the durable tier, every `every` steps of protection and on request: each agent's thread writes
the newest protected step to the persist directory (or a node-local level, drained there) while the rounds go on, slot
0 commits once all are done. No pass starts while a flush reads the store: no store has over two slots pinned."""
from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpcft import events
from hpcft.agent.protection.bundle import Held, both, map_readonly, pin_targets
from hpcft.agent.transport.link import COUNT, Either
from hpcft.agent.transport.mesh import MeshBase
from hpcft.agent.protection.pins import Pins
from hpcft.agent.transport.throttle import Throttle, chore, unbilled
from hpcft.durable import catalog, commit, files, flush, local
from hpcft.durable.settings import PersistConfig
from hpcft.errors import HpcftError

IDLE, RUNNING, DRAINING, PREPARING, DONE, FAILED = "idle", "running", "draining", "preparing", "done", "failed"
# a round's flush vote, merged (`vote`, `combine`), as a peer must send it (link.mismatch)
VOTE = {"failed": [(COUNT, str)], "running": bool, "busy": bool, "asked": [str], "id": (COUNT, str),
        "durable": Either(COUNT, None), "protected": [COUNT], "complete": [COUNT], "world": COUNT}


def request_path(rendezvous: str | Path, tag: str) -> Path:
    """A request to the agents of launch `tag` to flush the newest protected step now: JSON {"id": ...}, each id
    served reported in their status (`flushed_request`)."""
    return Path(rendezvous) / f"agent-{tag}-flush"


def request(rendezvous: str | Path, tag: str) -> str:
    """Ask the agents of launch `tag` for a flush; the request id to wait for in their status."""
    rid = uuid.uuid4().hex[:12]
    files.put(request_path(rendezvous, tag), json.dumps({"id": rid, "time": time.time()}).encode(), sync=False)
    return rid


def outcome(reports: list[dict[str, Any]], rid: str, slots: int) -> tuple[bool, int | None, str | None]:
    """From the agents' reports: (every one of `slots` agents served request `rid` and finished its flush, the newest
    step durable for all, why the flush failed if it did)."""
    durable = min((r["persisted"] for r in reports if r.get("persisted") is not None), default=None)
    served = len(reports) == slots and all(r.get("flushed_request") == rid and not r.get("flushing") for r in reports)
    return served, durable, next((r["flush_error"] for r in reports if r.get("flush_error")), None) if served else None


def read_request(rendezvous: str | Path, tag: str) -> str | None:
    try:
        return str(json.loads(request_path(rendezvous, tag).read_text())["id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


class Flusher:
    """One agent's side of the flush, driven by `round` (collective: every agent calls it once per round); `wake`
    is called when this node's part is written, so that the round which commits it need not wait for the interval."""

    def __init__(self, cfg: PersistConfig, job: Path, job_id: str, slot: int, pins: Pins,
                 requests: Callable[[], str | None], wake: Callable[[], None] = lambda: None):
        self.cfg, self.job, self.job_id, self.slot, self.wake = cfg, job, job_id, slot, wake
        self.root = Path(cfg.root) if cfg.root else None
        self.pins, self.requests = pins, requests  # the newest flush asked for (agent/status.py Requests.flush)
        self.throttle = Throttle(cfg.rate)
        self.local = local.local_root(cfg.local) if self.root else None  # this node's first level, if any
        try:
            if self.local is not None:
                files.make_dir(self.local)
        except HpcftError as exc:  # this node flushes straight to the persist directory
            events.emit("local_unavailable", level=logging.WARNING, slot=slot, path=str(self.local), error=str(exc))
            self.local = None
        mine = local.copies(self.local, self.root)
        self.local_step: int | None = mine[-1].step if mine else None  # this node's newest first-level copy
        self._released = False  # every node's flush is past the store (from the last all-reduce: the same everywhere)
        newest = catalog.newest(self.root) if self.root else None
        self.durable: int | None = newest.step if newest else None
        self.served: str | None = None  # the newest request id served (the same on every agent)
        self.last_error: str | None = None  # why the last flush failed (None after a success)
        self._state, self._error = IDLE, ""
        self._step: int | None = None
        self._id = ""
        self._thread: threading.Thread | None = None
        self._started = 0.0
        self._bytes = 0
        self._world = 0
        self._failed_at: int | None = None  # the step of the last failed flush: no automatic retry before `every` more
        self._cancel = threading.Event()

    @property
    def busy(self) -> bool:
        """A flush is under way (its write, or its drain to the shared file system)."""
        return self._step is not None

    @property
    def pinning(self) -> bool:
        """A flush may still read the store: no protection pass starts meanwhile. From the last round's all-reduce,
        so every agent decides the same."""
        return self._step is not None and not self._released

    @property
    def phase(self) -> str | None:
        """`running` (writing from the store), `draining` (node-local copy to the shared file system), `preparing`
        (slot 0 loading what the commit needs), or None."""
        return self._state if self.busy else None

    def round(self, mesh: MeshBase, complete: dict[int, dict[int, Held]], protected: list[int]) -> None:
        """One collective step: start a flush when due or asked (the same decision everywhere, from the all-reduced
        votes), or, once every node has written its part, let slot 0 commit it."""
        if self.root is None:
            return
        asked = self.requests()
        mine = vote(self.slot, self._state, self._error, asked, uuid.uuid4().hex[:8], self.durable,
                    [s for s in protected if s in complete][-4:], sorted(complete)[-4:], _world(complete))
        states = mesh.allreduce(mine, combine, VOTE)  # log2 N messages of one vote each, whatever the job's size
        if self._step is not None:
            self._progress(mesh, states)
            return
        self.durable = states["durable"] if states["durable"] is not None else self.durable
        asks = set(states["asked"]) - {None, self.served}
        target = max(states["protected"], default=None)
        if target is None and asks:
            target = max(states["complete"], default=None)
        # the first one too only after `every` steps: a short run (or test) writes nothing but what a requeue asks for
        due = target is not None and target - (self.durable or 0) >= self.cfg.every \
            and (self._failed_at is None or target - self._failed_at >= self.cfg.every)
        if target is not None and self.durable is not None and target <= self.durable:
            if asks:  # the newest step is durable already: the request is served
                self.served = max(asks)
                events.emit("flush_done", step=self.durable, slot=self.slot, reason="already durable")
            return
        if not (due or asks) or target is None:
            return
        if asks:
            self.served = max(asks)
        self._start(target, complete[target], f"{self.job_id}-{states['id'][1]}", states["world"],
                    "requested" if asks else f"every {self.cfg.every} steps")

    def _start(self, step: int, held: dict[int, Held], flush_id: str, world: int, why: str) -> None:
        self._step, self._id, self._state, self._error, self._bytes = step, flush_id, RUNNING, "", 0
        self._world, self._started = world, time.perf_counter()
        self._cancel.clear()
        self._released = False
        tmp = self.root / catalog.tmp_name(step, flush_id)
        events.emit("flush_start", step=step, slot=self.slot, path=str(tmp), reason=why,
                    local=str(self.local) if self.local else None)
        self._thread = chore(self._write, step, held, tmp, name="hpcft-flush")  # its CPU is not protection's
        self._thread.start()

    def _write(self, step: int, held: dict[int, Held], tmp: Path) -> None:
        """This node's ranks of `step` into `tmp`, or first into the node-local level and then drained to `tmp`."""
        try:
            first = self.local / catalog.tmp_name(step, self._id) if self.local else tmp
            self._from_store(step, held, first, self._pace if first == tmp else self._cancelled)
            if self.local is not None:
                copy = local.publish(first, self.local, step, self._world, sorted(held), self.job_id, self._id,
                                     self.root, self.cfg.keep)
                self.local_step = step
                events.emit("flush_local", step=step, slot=self.slot, path=str(copy.path), bytes=self._bytes,
                            seconds=round(time.perf_counter() - self._started, 3))
                self._state = DRAINING
                local.drain(copy, tmp, pace=self._pace, sync=self.cfg.sync)
            if self.slot == 0:  # the committer loads what the commit needs here, past the store, not on the rounds'
                self._state = PREPARING  # thread: torch's import cost the first commit ~2 s of every agent's rounds
                commit.prepare()  # (not at the agent's start: an agent stopped mid-import lingers until it ends)
            self._state = DONE
        except (HpcftError, OSError, ImportError) as exc:
            self._error = f"drain to {self.root}: {exc}" if self._state == DRAINING else str(exc)
            self._state = FAILED
        finally:
            self.wake()

    def _from_store(self, step: int, held: dict[int, Held], dest: Path, pace) -> None:
        """Write this node's ranks of `step` into `dest`, pinned meanwhile (pin first, then check the version is still
        the one read: the writer withdraws first, then checks the pin)."""
        with self.pins.holding(pin_targets(step, held)):
            if not all(h.manifest_path.read_bytes() == h.manifest_bytes for h in held.values()):
                raise HpcftError(f"the trainers reused a slot of step {step} before the flush pinned it")
            files.make_dir(flush.sidecar_dir(files.make_dir(dest)))
            for rank, h in sorted(held.items()):
                data = map_readonly(h.data_path, int(h.manifest["data_bytes"]))
                side = flush.write_rank(h.manifest, data, dest, pace=pace, sync=self.cfg.sync)
                self._bytes += side["file_bytes"]

    def _cancelled(self, _nbytes: int = 0) -> None:
        if self._cancel.is_set():
            raise HpcftError("cancelled: another node's part of this flush failed")

    def _pace(self, nbytes: int) -> None:
        """The cap on writes to the shared file system (a direct flush, or the drain)."""
        self._cancelled()
        self.throttle.take(nbytes)

    def _progress(self, mesh: MeshBase, states: list[dict[str, Any]]) -> None:
        failed = [f"slot {i}: {error}" for i, error in states["failed"]]
        self._released = not states["running"]  # every store free: protection may go on
        if not failed and states["busy"]:
            return
        step, tmp = self._step, self.root / catalog.tmp_name(self._step, self._id)
        error = "; ".join(failed)
        if not failed and self.slot == 0:
            try:
                with unbilled():
                    commit.commit(tmp, self.root, step, self._world, self.job_id, self.cfg.keep)
            except HpcftError as exc:
                error = f"commit: {exc}"
        outcome = mesh.allgather([error, self._bytes], (str, COUNT))  # once per flush: slot 0's commit outcome
        error = next((e for e, _ in outcome if e), "")
        seconds = time.perf_counter() - self._started
        nbytes = sum(b for _, b in outcome)
        if self._thread is not None:  # another node failed: stop writing here before the state is reset
            self._cancel.set()
            self._thread.join()
        self.last_error = error or None
        if error:
            self._failed_at = step
            events.emit("flush_failed", level=logging.ERROR, step=step, slot=self.slot, error=error,
                        durable=self.durable, local=self.local_step,
                        action="the previous durable checkpoint stays; the next flush retries")
        else:
            self.durable = step
            events.emit("flush_done", step=step, slot=self.slot, bytes=nbytes, seconds=round(seconds, 3),
                        bandwidth=round(nbytes / seconds) if seconds > 0 else None)
        self._step, self._state, self._error, self._thread = None, IDLE, "", None


def vote(slot: int, state: str, error: str, asked: str | None, flush_id: str, durable: int | None,
         protected: list[int], complete: list[int], world: int) -> dict[str, Any]:
    """One agent's part of a round's flush decision, as `combine` merges it (pure)."""
    return {"failed": [[slot, error]] if state == FAILED else [], "running": state == RUNNING,
            "busy": state in (RUNNING, DRAINING, PREPARING), "asked": [] if asked is None else [asked],
            "id": [slot, flush_id],
            "durable": durable, "protected": protected, "complete": complete, "world": world}


def combine(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two votes merged (pure; associative, commutative, idempotent): the failures and requests of either, whether
    any writes, the lowest slot's flush id, the newest durable step, the steps both hold, the largest world."""
    durable = [d for d in (a["durable"], b["durable"]) if d is not None]
    return {"failed": sorted(map(list, {(int(i), str(e)) for i, e in a["failed"] + b["failed"]})),
            "running": a["running"] or b["running"], "busy": a["busy"] or b["busy"],
            "asked": sorted(set(a["asked"]) | set(b["asked"])), "id": min(a["id"], b["id"]),
            "durable": max(durable) if durable else None, "protected": both(a["protected"], b["protected"]),
            "complete": both(a["complete"], b["complete"]), "world": max(a["world"], b["world"])}


def _world(complete: dict[int, dict[int, Held]]) -> int:
    """The job's world size, as the newest complete step's manifests record it (0 if there is none)."""
    held = complete[max(complete)] if complete else {}
    return max((int(h.manifest.get("world") or 0) for h in held.values()), default=0)
