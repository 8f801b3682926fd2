"""The agents' part in a requeue or an elastic grow (`persist`): once the trainers have stopped, protect the newest
step they completed everywhere (`drain`) and flush it to the durable tier (`flush`); and, before the agents stop,
a flush under way finishes (`_finish_flush`). Mixed into AgentSteps, whose launch (tag, step, reports) it asks."""
from __future__ import annotations

import logging
import time

from hpcft.agent.protection import flush as agent_persist

PERSIST_POLL_S = 0.05  # a persist's and a stop's waits read the agents' reports (in memory, or files) this often


class Persisting:
    """AgentSteps' persist: uses its `cfg`, `tag`, `proc`, `rendezvous`, `emit`, `_ask`, `_read`, `_ready_slots`,
    `_forwarded`, `_interrupted` and `protected`."""

    def drain(self, deadline: float) -> str | None:
        """Once the trainers have stopped: ask the agents to protect the newest step without caps, and wait until
        every one reports it protected. None when it is, else why not (their step ended, or `deadline`, a
        time.monotonic() value, passed)."""
        stopped = time.time()
        self._ask(drain=True)
        while True:
            fresh = [r for r in self._read(self.tag).values() if r.get("time", 0) > stopped]
            if fresh and len(fresh) == len(self._ready_slots or ()):
                held = set.intersection(*(set(r.get("staged_steps") or ()) for r in fresh))
                newest = max(held, default=None)
                if newest is None or all((r.get("protected") or -1) >= newest for r in fresh):
                    return None
            if self.proc is None or self.proc.poll() is not None:
                return "the agents' step ended before protecting the newest step"
            if time.monotonic() > deadline:
                return ("the newest step was not protected within --protect-timeout "
                        f"{self.cfg.protection.protect_timeout:g} s")
            time.sleep(PERSIST_POLL_S)

    def flush(self, deadline: float) -> tuple[int | None, str | None]:
        """Ask the agents to flush the newest protected step to the durable tier and wait until every one reports
        the request served: (the newest durable step, None), or (the newest durable step the agents know of, why
        the flush did not happen) when their step ended or `deadline` (time.monotonic()) passed."""
        rid = agent_persist.request(self.rendezvous, self.tag)
        self._forwarded = rid
        self._ask(flush=rid)
        while True:
            reports = list(self._read(self.tag).values())
            served, durable, error = agent_persist.outcome(reports, rid, len(self._ready_slots or ()))
            if served:
                return durable, error
            if self.proc is None or self.proc.poll() is not None:
                return durable, "the agents' step ended before the flush"
            if time.monotonic() > deadline:
                return durable, ("the flush did not finish within --protect-timeout "
                                 f"{self.cfg.protection.protect_timeout:g} s")
            time.sleep(PERSIST_POLL_S)

    def persist(self, bad_nodes: tuple[str, ...] | list[str] = ()) -> tuple[int | None, int | None, str | None]:
        """Before a requeue or elastic grow: protect the newest step the trainers completed everywhere and flush it, by
        --protect-timeout, so the next allocation can rebuild it from returning nodes or read it on new ones; event
        `persist`. (protected step, durable step, why either is not done or None)."""
        started = time.monotonic()
        if self.proc is None:  # none configured, or none running (their step ended; a successor stopped them)
            why = "no agents (--protect none, --persist-dir none)" if not self.cfg.with_agents else \
                "no agents running (their step ended, or a successor stopped its predecessor's)"
            self.emit("persist", level=logging.WARNING, done=False, how="none",
                      reason=f"{why}: the next allocation resumes from what its nodes hold")
            return None, None, why
        deadline = started + self.cfg.protection.protect_timeout
        if bad_nodes:
            why = (f"node(s) {','.join(bad_nodes)} lost: the newest step their sets protected before is what "
                   "the next allocation can rebuild")
        elif self.cfg.protection.protected:
            why = self.drain(deadline)
        else:
            why = None
        durable, flush_why = None, "no durable tier (--persist-dir none)"
        if self.cfg.durable.persisting and not bad_nodes:  # a lost node's agent broke the mesh: no flush is possible
            durable, flush_why = self.flush(deadline)
        elif self.cfg.durable.persisting:  # the newest step the agents last reported durable (no request was made)
            reports = list(self._read(self.tag).values())
            durable = agent_persist.outcome(reports, rid="", slots=len(reports))[1]
            flush_why = "a node was lost: the agents cannot flush together; " + (
                f"the durable step {durable} stays" if durable is not None else
                "no step is durable yet: the next allocation has only what the nodes' memory holds")
        done, protected = why is None or flush_why is None, self.protected()
        self.emit("persist", level=logging.INFO if done else logging.WARNING, done=done,
                  how="protect+flush" if self.cfg.protection.protected and self.cfg.durable.persisting else
                  "flush" if self.cfg.durable.persisting else "protect",
                  protected=protected, durable=durable, seconds=round(time.monotonic() - started, 3),
                  **({"reason": why} if why else {}), **({"flush_reason": flush_why} if flush_why else {}))
        return protected, durable, why or flush_why

    def _finish_flush(self) -> None:
        """A flush under way (its drain from node-local storage, which Frontier wipes at the job's end, above all)
        finishes before the agents are stopped, for up to --protect-timeout, unless `hpcft run` got SIGTERM (event
        `flush_wait`)."""
        started = time.monotonic()
        waited = False
        while self.proc is not None and self.proc.poll() is None and not self._interrupted() \
                and time.monotonic() < started + self.cfg.protection.protect_timeout:  # SIGTERM: Slurm's grace is short
            if not any(r.get("flushing") for r in self._read(self.tag).values()):
                break
            waited = True
            time.sleep(PERSIST_POLL_S)
        if waited:
            busy = [r for r in self._read(self.tag).values() if r.get("flushing")]
            self.emit("flush_wait", level=logging.WARNING if busy else logging.INFO, done=not busy,
                      seconds=round(time.monotonic() - started, 3))
