"""The process's MPI, funnelled through one thread (MPI_THREAD_FUNNELED) that alone calls it; the agent's other
threads hand it nonblocking operations (`Op`) and wait on an Event, so an abort ends every wait at once (MPI has no
timeouts and cannot cancel a send). Every MPI grants FUNNELED (Cray MPICH grants MULTIPLE only with
MPICH_MAX_THREAD_SAFETY=multiple, then locks every call). The cost: completions are polled (`Poller`), µs a poll."""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from contextlib import suppress
from typing import Any

from hpcft import deps
from hpcft.agent.transport.link import TransportError
from hpcft.errors import ConfigError, MissingDependencyError

FINALIZE_S = 2.0  # the most a clean close waits for every other agent to close too, before MPI_Finalize


def load_mpi() -> Any:
    """mpi4py's MPI module, not yet initialised; MissingDependencyError without mpi4py, ConfigError without its MPI."""
    mpi4py = deps.require("mpi4py", "the agents' MPI transport (--agent-transport mpi)")
    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError, OSError) as exc:
        raise ConfigError(f"mpi4py {mpi4py.__version__} is installed but its MPI library cannot be loaded ({exc}): "
                          "load the MPI the site built it against (e.g. `module load cray-mpich`), or rebuild it "
                          "against this one: pip install --no-binary=mpi4py --force-reinstall mpi4py") from exc
    return MPI


def library() -> str:
    """The first line of the MPI library mpi4py runs on (the check before a launch); ConfigError when unusable."""
    try:
        MPI = load_mpi()
        return MPI.Get_library_version().splitlines()[0].strip()
    except MissingDependencyError as exc:
        raise ConfigError(f"--agent-transport mpi: {exc}") from exc


class Op:
    """One nonblocking MPI operation: done when MPI completes it or when it is failed (`fail`), whichever comes first.
    `idle`: nobody waits on it (a standing notice receive), so the poller need not poll while only such are left."""

    def __init__(self, what: str, idle: bool = False, on_done: Callable[[Op], None] | None = None):
        self.what, self.idle, self.on_done = what, idle, on_done
        self.count: int | None = None
        self.expect: int | None = None  # the bytes a receive must get (a payload piece), None: any up to its buffer
        self.error: BaseException | None = None
        self.req: Any = None
        self._lock = threading.Lock()
        self._done = threading.Event()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def finish(self, count: int) -> bool:
        return self._settle(count=count)

    def fail(self, exc: BaseException) -> bool:
        return self._settle(error=exc)

    def _settle(self, **outcome) -> bool:
        """Record the operation's outcome once (False if it was already settled) and wake its waiter."""
        with self._lock:
            if self._done.is_set():
                return False
            for name, value in outcome.items():
                setattr(self, name, value)
            self._done.set()
        return True

    def wait(self, timeout: float | None = None) -> int:
        """The bytes it moved; its error raised; TransportError after `timeout` seconds."""
        if not self._done.wait(timeout):
            raise TransportError(f"MPI {self.what}: not done within {timeout:g} s")
        if self.error is not None:
            raise self.error
        return int(self.count or 0)


class Poller:
    """The MPI thread's sleep before its next poll (pure; None: until something is posted): none right after a
    completion (Open MPI over TCP moves bytes only inside MPI calls), then doubling from `first` to `busy_max` while
    someone waits (the polls' CPU counts against the agent's cap); None while only standing receives are posted."""

    def __init__(self, first: float = 1e-5, busy_max: float = 0.02):
        self.first, self.busy_max, self.delay = first, busy_max, 0.0

    def next(self, completed: bool, waited: bool) -> float | None:
        if completed:
            self.delay = 0.0
        elif not waited:
            self.delay = 0.0
            return None
        else:
            self.delay = min(self.busy_max, max(self.first, self.delay * 2))
        return self.delay


class World:
    """MPI in this process (one per process: `world()`): `call(post)` runs `post(MPI, comm)` in the MPI thread, which
    returns a Request (completed by the poller) or a value; `rank`, `size`, `comm` (MPI_COMM_WORLD, errors returned)."""

    def __init__(self) -> None:
        self._queue: deque[tuple[Callable[[Any, Any], Any], Op]] = deque()
        self._cond = threading.Condition()
        self._active: list[Op] = []
        self._stopping = False
        self._ready = Op("init")
        self.rank = self.size = -1
        self.comm: Any = None
        self.MPI = load_mpi()
        self.version = self.MPI.Get_library_version().splitlines()[0].strip()
        self._thread = threading.Thread(target=self._run, name="hpcft-mpi", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float) -> None:
        self._ready.wait(timeout)

    def call(self, post: Callable[[Any, Any], Any], what: str, *, idle: bool = False,
             on_done: Callable[[Op], None] | None = None) -> Op:
        op = Op(what, idle, on_done)
        with self._cond:
            if self._stopping:
                op.fail(TransportError(f"MPI {what}: this process's MPI is closed"))
                return op
            self._queue.append((post, op))
            self._cond.notify()
        return op

    def cancel(self, op: Op) -> None:
        """Cancel `op`'s request unless MPI completed it (a receive: MPI cannot cancel a send), freeing its buffer."""
        def post(MPI: Any, _comm: Any) -> None:
            op.idle = True
            if op.req is not None and op.req != MPI.REQUEST_NULL:
                with suppress(MPI.Exception):
                    op.req.Cancel()

        self.call(post, f"cancel of {op.what}")

    def close(self, finalize: bool) -> bool:
        """Stop the MPI thread; with `finalize`, MPI_Finalize first, once a barrier shows every agent closing within
        FINALIZE_S (a fence holding the GIL: one lost agent would hold this process, signals too). Whether it was."""
        done = False
        if finalize:
            try:
                self.call(lambda _MPI, comm: comm.Ibarrier(), "barrier before MPI_Finalize").wait(FINALIZE_S)
                self.call(self._finalize, "finalize").wait()  # every agent is at its close: a short fence
                done = True
            except TransportError:
                pass
        with self._cond:
            self._stopping = True
            self._cond.notify()
        return done

    def _finalize(self, MPI: Any, _comm: Any) -> int:
        """In the MPI thread: cancel what is still posted (MPI_Finalize wants no request pending), then finalize."""
        for op in self._active:
            with suppress(MPI.Exception):
                op.req.Cancel()
                op.req.Test()
        self._active = []
        MPI.Finalize()
        return 0

    def _run(self) -> None:
        MPI = self.MPI
        try:
            provided = MPI.Init_thread(MPI.THREAD_FUNNELED)
            if provided < MPI.THREAD_FUNNELED:
                raise TransportError(f"MPI granted thread level {provided}, below MPI_THREAD_FUNNELED")
            self.comm = MPI.COMM_WORLD
            self.comm.Set_errhandler(MPI.ERRORS_RETURN)
            self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        except Exception as exc:  # MPI.Exception, a library that fails to start: the agent reports it
            self._ready.fail(exc if isinstance(exc, TransportError) else
                             TransportError(f"MPI_Init_thread failed ({self.version}): {exc}"))
            return
        self._ready.finish(0)
        poll = Poller()
        while True:
            with self._cond:
                todo = list(self._queue)
                self._queue.clear()
            for post, op in todo:
                self._post(post, op)
                if op.what == "finalize":
                    return
            if self._stopping:
                return
            completed = self._test() if self._active else False
            delay = poll.next(completed, any(not op.idle for op in self._active))
            if delay != 0.0:
                with self._cond:
                    if not self._queue and not self._stopping:
                        self._cond.wait(delay)

    def _post(self, post: Callable[[Any, Any], Any], op: Op) -> None:
        MPI = self.MPI
        try:
            out = post(MPI, self.comm)
        except Exception as exc:
            self._settle(op, exc=TransportError(f"MPI {op.what} failed: {exc}"))
            return
        if isinstance(out, MPI.Request):
            op.req = out
            self._active.append(op)
        else:
            self._settle(op, count=out if isinstance(out, int) else 0)

    def _test(self) -> bool:
        """Complete what MPI has completed; whether anything was."""
        MPI = self.MPI
        statuses = [MPI.Status() for _ in self._active]
        reqs = [op.req for op in self._active]
        try:
            idx = MPI.Request.Testsome(reqs, statuses) or []
        except MPI.Exception:  # MPI_ERR_IN_STATUS: find the failed ones one by one
            idx = []
            for i, op in enumerate(self._active):
                try:
                    if op.req.Test(statuses[len(idx)]):
                        idx.append(i)
                except MPI.Exception as exc:
                    self._settle(op, exc=TransportError(f"MPI {op.what} failed: {exc.Get_error_string()}"))
                    idx.append(i)
        if not idx:
            return False
        for k, i in enumerate(idx):  # MPI_Testsome's statuses come in the order of its indices
            op, status = self._active[i], statuses[k]
            if status.Is_cancelled():
                self._settle(op, exc=TransportError(f"MPI {op.what} was cancelled"))
            else:
                self._settle(op, count=status.Get_count(MPI.BYTE))
        gone = set(idx)
        self._active = [op for i, op in enumerate(self._active) if i not in gone]
        return True

    @staticmethod
    def _settle(op: Op, count: int = 0, exc: BaseException | None = None) -> None:
        first = op.fail(exc) if exc is not None else op.finish(count)
        if first and op.on_done is not None:
            op.on_done(op)


_WORLD: World | None = None
_LOCK = threading.Lock()


def world(timeout: float) -> World:
    """This process's MPI, initialised on first use (TransportError when it does not start within `timeout`)."""
    global _WORLD
    with _LOCK:
        if _WORLD is None:
            _WORLD = World()
    _WORLD.wait_ready(timeout)
    return _WORLD


def release(finalize: bool) -> bool:
    """Close this process's MPI (World.close); a later `world` would fail: MPI cannot be initialised twice."""
    with _LOCK:
        return _WORLD.close(finalize) if _WORLD is not None else False
