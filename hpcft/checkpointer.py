"""The training-side API: `Checkpointer` snapshots model + optimizer + RNG + `extra` into node-local
memory after optimizer steps, and `restore()` brings the newest complete snapshot back.

Step numbering: a snapshot of step s holds the state after s optimizer steps (s >= 1). `restore()`
returns s, the number of completed steps, which is also the 0-based index of the next loop iteration:
`for it in range(ckpt.restore(), total)` resumes exactly where the snapshot left off; 0 means a fresh
run (nothing to restore). A failed restore raises (IntegrityError / CheckpointError), never returns 0.
"""
import copy
import json
import time
import logging
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from hpcft import events
from hpcft.env import DEFAULT_JOB_ID, job_env
from hpcft.errors import CheckpointError, ConfigError
from hpcft.inprocess import record as restart_record
from hpcft.inprocess import shield
from hpcft.options import Options
from hpcft.snapshot import calibration, copiers, groups, rng, state, timing
from hpcft.snapshot.engine import SnapshotEngine, Stats
from hpcft.durable import catalog, local, resume
from hpcft.snapshot.restore import Loader
from hpcft.snapshot.view import StateView
from hpcft.store import RankStore, owner, prefetch
from hpcft.store.writer import writer_id

_log = logging.getLogger(__name__)


class Checkpointer:
    """In-memory snapshots of one model and its optimizer (docs/reference/checkpointing.md), taken and kept as `options`
    says (hpcft.Options: every, keep, auto, where the store and the durable tier are, how to copy).

    extra: a callable returning a JSON-able dict (e.g. data-loader position), recorded with each snapshot;
           after restore() the saved dict is in `ckpt.extra` and is passed to `on_restore` if given.
    dp_group: the data-parallel group; replicated state is split across its members (each copies 1/DP). Any group
              works, NCCL/RCCL ones too (hpcft pairs it with a gloo group of the same ranks, made here: collective,
              every rank passing the one data-parallel group it belongs to, or all None).
    on_restore: a callable given the restored `extra` dict after a successful restore().
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, options: Options | None = None,
                 *, extra: Callable[[], dict] | None = None, dp_group: Any = None,
                 on_restore: Callable[[dict | None], None] | None = None):
        opts = self.options = options or Options()
        if not isinstance(opts, Options):
            raise ConfigError(f"options must be an hpcft.Options (got {type(opts).__name__}); extra, dp_group and "
                              "on_restore are keyword arguments")
        if extra is not None and not callable(extra):
            raise ConfigError("extra must be a callable returning a JSON-able dict (e.g. lambda: {'pos': pos})")
        if optimizer is None and opts.auto:
            raise ConfigError("auto snapshots need an optimizer; pass Options(auto=False) and call ckpt.step(it)")
        self.model, self.optimizer = model, optimizer
        self._extra_fn, self._on_restore = extra, on_restore
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.job_id = str(opts.job_id or job_env().job_id)
        # a relaunch's newest snapshot, mapped while the rest of this and restore()'s set-up runs (the restore's Slot
        # adopts it, helping with what is left); a no-op where hpcft.init started it already or nothing is stored
        prefetch.ahead(self.job_id, self.rank, opts.root, threads=prefetch.threads(busy=1))
        self._writer = writer_id()
        shared = not opts.job_id and self.job_id == DEFAULT_JOB_ID  # any local run may have written this store
        self.owner = owner.Owner(self.job_id, self._writer if shared else None, owner.adoption(opts.adopt))
        self.comm = groups.comm(dp_group)
        self.group = self.comm.dp
        self._view = StateView(model, optimizer, frozenset(self.group.ranks) if self.group else None)
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        backend = copiers.choose(opts.backend, device)
        # the copy method: calibrated on this host for the CPU backend, explicit options first (calibration)
        self.copy_settings = calibration.settings(backend, copiers.default_threads(backend), opts.threads,
                                                  opts.chunk_bytes)
        self.threads = self.copy_settings.snapshot.threads
        self.store = RankStore(self.job_id, self.rank, keep=opts.keep, root=opts.root)
        self.persist_dir: Path | None = catalog.persist_root(opts.persist_dir)
        self.persist_local: Path | None = local.local_root(
            str(opts.persist_local) if opts.persist_local is not None else None)
        copier = copiers.make(backend, device, max_inflight_bytes=opts.max_inflight_bytes, threads=self.threads,
                              overlap=opts.overlap, kernel=self.copy_settings.snapshot.kernel)
        self.engine = SnapshotEngine(self.store, copier, group=self.group,
                                     chunk_bytes=self.copy_settings.snapshot.chunk_bytes or copier.chunk_bytes)
        self._loader = Loader(self.store, self.group, self.copy_settings.restore.threads, world=self.comm.world,
                              kernel=self.copy_settings.restore.kernel)
        self.backend = backend
        self.completed = 0  # optimizer steps applied to the live state
        self.extra: dict | None = None
        self._quiet = False  # hooks ignore optimizer steps hpcft itself makes
        self._in_step = False  # the pre-step hook opened a shielded section the post-step hook closes
        self._warned = False
        self.timer = timing.StepTimer(timing.clock_for(device))  # the rank's own share of a step (stragglers)
        self._hooks = timing.grad_hooks(model, self.timer.grad)
        if optimizer is not None:
            self._hooks.append(optimizer.register_step_pre_hook(self._pre_step))
            if opts.auto:
                self._hooks.append(optimizer.register_step_post_hook(self._post_step))

    # the two optimizer hooks -----------------------------------------------------------------------------
    # The optimizer's step, from the pre-step hook to the end of the post-step one, is a shielded section
    # (hpcft.inprocess.shield): a peer's fault interrupts this rank after the step's snapshot started, not inside it.
    def _pre_step(self, *_: Any) -> None:
        if not self._quiet:
            self._leave_step()  # a previous step that raised before its post-step hook
            shield.enter()
            self._in_step = True
            self.timer.ended()
            self.engine.guard()

    def _post_step(self, *_: Any) -> None:
        if self._quiet:
            return
        try:
            with shield.section():  # also where no pre-step hook opened one (hooks added mid-step)
                self.completed += 1
                if self.completed % self.options.every == 0:
                    self._snapshot()
                self.timer.started()
        finally:
            self._leave_step()

    def _leave_step(self) -> None:
        if self._in_step:
            self._in_step = False
            shield.leave()

    # public API --------------------------------------------------------------------------------------------
    def step(self, it: int) -> None:
        """Mark the end of loop iteration `it` (0-based): the state now holds it + 1 steps. With auto=False this takes
        the snapshot; with auto=True the optimizer hook normally took it, and where the hook's count disagrees (a
        skipped optimizer step, hooks added late) the loop's count wins and the snapshot is taken here."""
        if self.options.auto and self.completed == it + 1:
            return
        if self.options.auto and not self._warned:
            self._warned = True
            _log.warning("ckpt.step(%d): the optimizer hook counted %d steps; numbering by the loop from now on",
                         it, self.completed)
        with shield.section():
            self.completed = it + 1
            if self.optimizer is None:  # no pre-step hook closes the step
                self.timer.ended()
            if self.completed % self.options.every == 0:
                self.engine.guard()
                self._snapshot()
                if self.optimizer is None:  # no pre-step hook to order the next update after the copy
                    self.engine.guard()
            self.timer.started()

    def _snapshot(self) -> None:
        t0 = time.perf_counter()  # the training thread's time from here on is the snapshot's
        extra = self._extra_fn() if self._extra_fn else None
        try:
            json.dumps(extra)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"extra() must return a JSON-able dict ({exc})") from exc
        generators = rng.grab()
        entries = self._view.entries()
        meta = {"world": self.world, "job_id": self.job_id, "writer": self._writer, "extra": extra,
                "optim": state.optimizer_meta(self.optimizer, self._view.optim_shape), "timing": self.timer.report()}
        self.engine.snapshot(self.completed, entries, meta, started=t0, late=lambda: {"rng": rng.encode(generators)})

    def snapshot(self) -> None:
        """Take a snapshot of the current state now, as step `completed` (e.g. before a planned exit)."""
        with shield.section():
            self.engine.guard()
            self._snapshot()

    def wait(self) -> None:
        """Block until the last snapshot is committed (or has failed, with its event)."""
        self.engine.wait()

    def restore(self) -> int:
        """Load the newest step complete on every rank (collective), from memory or the durable tier (order:
        hpcft.durable.resume), and return it: the optimizer steps it holds = the next loop index; 0 on a fresh run.
        Raises if checkpoints exist but none could be loaded."""
        self.engine.wait()

        def live() -> list[state.Entry]:
            self._quiet = True
            try:
                state.ensure_optimizer_state(self.optimizer)
            finally:
                self._quiet = False
            return self._view.entries()

        got = resume.restore(self._loader, live, self.persist_dir, self._check_meta, self.world, self.persist_local,
                             self.owner)
        if got is None:
            self.completed, self.extra = 0, None
            restart_record.restored(0)  # an in-process restart's event, if one is under way
            return 0
        m = got.meta
        taken = owner.stranger(m, self.owner, durable=got.source != resume.MEMORY)
        if taken is not None:  # adopted, or another job's durable checkpoint: loaded, and said
            events.emit("restore_adopted", level=logging.WARNING, rank=self.rank, step=got.step, source=got.source,
                        job=taken.job, writer=taken.writer or "", own_job=self.job_id, reason=taken.why)
        rng.restore(m["rng"])
        state.apply_optimizer_meta(self.model, self.optimizer, m.get("optim") or {})
        self.completed, self.extra = got.step, copy.deepcopy(m.get("extra"))  # the manifest is the store's cache
        if self._on_restore:
            self._on_restore(self.extra)
        restart_record.restored(got.step)
        return got.step

    def _check_meta(self, m: dict[str, Any]) -> None:
        """What restore() applies after the load (RNG, optimizer settings) is checked with the load, so that a bad
        manifest fails its version on every rank together."""
        rng.check(m["rng"])
        state.check_optimizer_meta(self.optimizer, m.get("optim"))

    @property
    def stats(self) -> Stats:
        """Counters: snapshots, bytes, blocked_s (training thread), copy_s, last_* and a per-snapshot history."""
        return self.engine.stats

    def close(self) -> None:
        """Finish the last snapshot, remove the hooks, release threads and mappings (snapshots stay)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        try:
            self._loader.close()
            self.engine.close()
            prefetch.release()  # a mapping made ahead for a restore that never came
        finally:
            self._leave_step()  # a step that raised left its section open: closed after the snapshot is finished

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
