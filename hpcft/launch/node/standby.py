"""`python -m hpcft.launch.node.standby`: a node's warm standby (active and spare nodes). It imports torch's start-up
(`--preload`) and listens on a unix socket in the node-local store root; a trainer task's wrapper (node/warm.py) sends
its command, environment, cwd, affinity and stdio, and a forked child becomes that rank, its exit status sent back. No
CUDA/HIP and no thread after the preload: `fork_unsafe` refuses a fork otherwise, and the wrapper runs cold, loudly."""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import selectors
import signal
import socket
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from hpcft import events
from hpcft.agent.transport import autogroup
from hpcft.launch.node import progress, zygote
from hpcft.launch.node.standby_child import Job, run_child
from hpcft.slurm.nodelist import expand
from hpcft.launch.config.sections import DEFAULT_PRELOAD

STATUS_DIR = "standby"  # <job dir>/standby/<node>.json: each standby's phase, for the supervisor's wait
_log = logging.getLogger(__name__)


def status_path(job_dir: str | os.PathLike, node: str) -> Path:
    return Path(job_dir) / STATUS_DIR / f"{node}.json"


def active_ready_path(job_dir: str | os.PathLike) -> Path:
    """Touched when the supervisor's wait for the active standbys ends: one file for every spare, not one per node."""
    return Path(job_dir) / STATUS_DIR / "active-ready"


def write_status(job_dir: str | os.PathLike, node: str, **fields) -> None:
    path = status_path(job_dir, node)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps({"node": node, "pid": os.getpid(), "time": time.time(), **fields}), encoding="utf-8")
    os.replace(tmp, path)


def native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def preload(modules: list[str]) -> float:
    """Import `modules` (seconds taken); ImportError names the one that failed."""
    started = time.monotonic()
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any failure of a user's module is reported the same way
            raise ImportError(f"--preload {name}: {type(exc).__name__}: {exc}") from exc
    return time.monotonic() - started


def _active_ready(marker: Path, since: float, done: threading.Event, behind: autogroup.Lowered,
                  timeout: float) -> None:
    """Give a spare's preload its priority back once the supervisor's wait for the active slots' standbys ended
    (`marker` touched at or after `since`: the launch waits for those, nobody for this one), or after `timeout`."""
    deadline = time.monotonic() + timeout
    while not done.wait(0.2) and time.monotonic() < deadline:
        try:
            if marker.stat().st_mtime >= since:
                break
        except OSError:
            continue
    behind.restore()


def _preload_behind(modules: list[str], job_dir: str, node: str, spares: list[str], since: float,
                    timeout: float = 120.0) -> tuple[float, autogroup.Lowered | None]:
    """`preload(modules)`, on one of `spares` at the lowest priority until the active nodes' standbys are ready
    (`active_ready_path`), which get shared cores first; its watcher thread ends before this returns (fork_unsafe)."""
    behind = autogroup.lower() if node in spares else None
    if behind is None:
        return preload(modules), None
    done = threading.Event()
    watcher = threading.Thread(target=_active_ready, args=(active_ready_path(job_dir), since, done, behind, timeout),
                               name="hpcft-standby-behind", daemon=True)
    watcher.start()
    try:
        return preload(modules), behind
    finally:
        done.set()
        watcher.join()
        behind.restore()


def calibrate() -> tuple[str, float]:
    """Resolve this node's CPU copy method now, before serving (measured once and cached per host in the store root,
    hpcft/snapshot/calibration): the first Checkpointer of a rank this standby starts, a spare's above all, then reads
    it instead of measuring on the recovery's critical path. (Where the method came from, seconds taken.)"""
    from hpcft.snapshot import calibration

    started = time.monotonic()
    got = calibration.resolve(1)  # the cache holds the samples, whatever thread count a rank picks from them
    return got.source, time.monotonic() - started


GPU_DRIVER_FILES = ("/dev/nvidia", "/dev/kfd", "/dev/dri/")  # what cuInit / hsa_init keep open


def gpu_driver_open(prefixes: tuple[str, ...] = GPU_DRIVER_FILES) -> str | None:
    """A GPU driver file held open: CUDA or HIP was initialised here, even by a `torch.cuda.is_available()`."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(prefixes):
            return target
    return None


def fork_unsafe(baseline_threads: int) -> str | None:
    """Why forking now would be unsafe, or None: a Python thread besides the main one, native threads started
    since the preload (numpy's OpenBLAS pool, there from the import, shuts down across fork: pthread_atfork), or
    CUDA/HIP initialised (a forked child cannot use it), by torch or by anything that opened the driver."""
    if threading.active_count() > 1:
        return f"Python threads running: {', '.join(t.name for t in threading.enumerate())}"
    now = native_threads()
    if now > baseline_threads:
        return f"{now} threads running, {baseline_threads} after the preload"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA/HIP is initialised in the standby"
    driver = gpu_driver_open()
    if driver:
        return f"a GPU driver is open in the standby ({driver}): CUDA/HIP was initialised"
    return None


@dataclass
class Standby:
    """The serving loop: one listening socket, one connection per running child, SIGCHLD through a wakeup pipe."""

    job_id: str
    node: str
    baseline_threads: int = 1
    start_env: dict[str, str] = field(default_factory=dict)  # the environment the preload ran in
    children: dict[int, socket.socket | None] = field(default_factory=dict)  # pid → its wrapper's connection
    served: int = 0
    refused: int = 0
    stopping: bool = False

    def listen(self) -> Path:
        """Bind the socket: its directory 0700 and ours alone, the socket 0600, a requeued run's stale one replaced."""
        directory = zygote.socket_dir(self.job_id)
        directory.mkdir(mode=0o700, exist_ok=True)
        st = directory.lstat()
        if st.st_uid != os.getuid() or not Path(directory).is_dir() or directory.is_symlink():
            raise PermissionError(f"{directory} is not a directory of uid {os.getuid()}: remove it")
        os.chmod(directory, 0o700)
        path = directory / "sock"
        path.unlink(missing_ok=True)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        old = os.umask(0o177)
        try:
            self.listener.bind(str(path))
        finally:
            os.umask(old)
        self.listener.listen(64)
        self.path = path
        return path

    def serve(self) -> Job | None:
        """Serve until stopped (None, in the standby) or until this process is a forked child (its Job)."""
        rfd, wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._pipe = (rfd, wfd)
        signal.set_wakeup_fd(wfd)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2):  # SIGUSR2: hpcft run's own stop
            signal.signal(sig, self._on_stop)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.listener, selectors.EVENT_READ, "accept")
        self.sel.register(rfd, selectors.EVENT_READ, "wake")
        while not self.stopping:
            for key, _ in self.sel.select(timeout=1.0):
                if key.data == "accept":
                    job = self._accept()
                    if job is not None:
                        return job
                elif key.data == "wake":
                    zygote.drain(rfd)
                else:
                    self._from_wrapper(key.fileobj, key.data)
            self._reap()
        self._shutdown()
        return None

    def _on_stop(self, *_) -> None:
        self.stopping = True

    def _accept(self) -> Job | None:
        conn, _ = self.listener.accept()
        try:
            uid = zygote.peer_uid(conn)
            if uid != os.getuid():
                events.emit("standby_refused", level=logging.WARNING, node=self.node, uid=uid,
                            reason="a peer of another user connected; closed")
                conn.close()
                return None
            conn.settimeout(10.0)
            request, fds = zygote.receive(conn)
        except (OSError, zygote.ProtocolError) as exc:
            _log.warning("hpcft standby: a connection failed: %s", exc)
            conn.close()
            return None
        if request is None:
            conn.close()
            return None
        why = self._refusal(request, fds)
        if why:
            self.refused += 1
            self._answer(conn, {"refused": why})
            for fd in fds:
                os.close(fd)
            conn.close()
            return None
        self._reap_orphans()
        with warnings.catch_warnings():  # checked just now (fork_unsafe); Python 3.12 warns of any thread at all
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            return self._become_child(request, conn, fds)
        with contextlib.suppress(OSError):
            os.setpgid(pid, pid)  # also in the child: whichever runs first
        self.served += 1
        for fd in fds:
            os.close(fd)  # the wrapper's stdio: the child holds them now (srun must see their end with the child)
        conn.settimeout(None)
        self.children[pid] = conn
        self.sel.register(conn, selectors.EVENT_READ, pid)
        return None

    def _refusal(self, request: dict, fds: list[int]) -> str | None:
        if len(fds) != 3:
            return f"{len(fds)} file descriptors sent, 3 expected (stdin, stdout, stderr)"
        if not zygote.same_interpreter(str(request.get("python", "")), sys.executable):
            return f"the wrapper runs {request.get('python')}, the standby {sys.executable}"
        mismatch = zygote.env_mismatch(request.get("env") or {}, self.start_env)
        if mismatch:
            return f"{mismatch} differs from the standby's (read when the interpreter and its libraries start)"
        return fork_unsafe(self.baseline_threads)

    @staticmethod
    def _answer(conn: socket.socket, message: dict) -> None:
        with contextlib.suppress(OSError):  # the wrapper is gone
            zygote.send(conn, message)

    def _from_wrapper(self, conn: socket.socket, pid: int) -> None:
        """A signal to forward, or the wrapper gone (srun killed the step): the child and its group go too."""
        try:
            message, fds = zygote.receive(conn)
        except (OSError, zygote.ProtocolError):
            message, fds = None, []
        for fd in fds:
            os.close(fd)
        if message is not None and isinstance(message.get("signal"), int):
            _kill(pid, message["signal"])
            return
        if message is None:
            _kill(pid, signal.SIGKILL)
            self.sel.unregister(conn)
            conn.close()
            self.children[pid] = None

    def _reap(self) -> None:
        while self.children:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if info is None:
                return
            pid = info.si_pid
            _kill(pid, signal.SIGKILL)  # what it left in its group (as a step's end would), while its zombie holds it
            _, status = os.waitpid(pid, 0)
            conn = self.children.pop(pid, None)
            if conn is not None:
                code = os.waitstatus_to_exitcode(status)
                self._answer(conn, {"signal": -code} if code < 0 else {"exit": code})
                self.sel.unregister(conn)
                conn.close()

    def _reap_orphans(self, timeout: float = 30.0) -> None:
        """Before a new child: wait for the children killed because their wrapper died to be gone, as srun's step
        ends only once its processes have: a relaunched rank never meets its predecessor in the store."""
        deadline = time.monotonic() + timeout
        for pid in [p for p, conn in self.children.items() if conn is None]:
            while time.monotonic() < deadline:
                try:
                    done, _ = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    done = pid
                if done:
                    self.children.pop(pid, None)
                    break
                time.sleep(0.01)

    def _shutdown(self) -> None:
        for pid in list(self.children):
            _kill(pid, signal.SIGKILL)
        self.listener.close()
        with contextlib.suppress(OSError):
            self.path.unlink(missing_ok=True)
            self.path.parent.rmdir()

    def _become_child(self, request: dict, conn: socket.socket, fds: list[int]) -> Job:
        """In the forked child: drop everything of the standby's loop but the one connection."""
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        self.sel.close()
        self.listener.close()
        for other in self.children.values():
            if other is not None:
                other.close()
        for fd in self._pipe:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)
        progress.die_with_parent()  # a standby that dies takes its ranks along: their wrappers see it and fail
        conn.settimeout(None)
        return Job(request, conn, fds)


def _kill(pid: int, sig: int) -> None:
    """`sig` to the child's process group (as a step's signal reaches all its processes), else to the child."""
    try:
        os.killpg(pid, sig)
    except OSError:
        with contextlib.suppress(OSError):
            os.kill(pid, sig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpcft.launch.node.standby", description=__doc__)
    ap.add_argument("--job-dir", required=True, help="hpcft run's job directory (status files, events)")
    ap.add_argument("--job", default=os.environ.get("HPCFT_JOB_ID") or os.environ.get("SLURM_JOB_ID"))
    ap.add_argument("--preload", default=DEFAULT_PRELOAD, help="comma-separated modules to import before serving")
    ap.add_argument("--spares", default="", help="the spare nodes (a Slurm hostlist): on one of them the preload runs "
                    "at the lowest priority against other sessions until the supervisor has the active nodes' "
                    "standbys ready, yielding to them where they share cores")
    ap.add_argument("--since", type=float, default=0.0, help="the step's start (epoch s): an older marker of the "
                    "active standbys' readiness is an earlier step's")
    args = ap.parse_args(argv)
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    spares = expand(args.spares) if args.spares else []
    standby = Standby(job_id=args.job or "local", node=node, start_env=dict(os.environ))
    modules = [m.strip() for m in args.preload.split(",") if m.strip()]
    try:
        seconds, behind = _preload_behind(modules, args.job_dir, node, spares, args.since)
        copy_method, calibrate_s = calibrate()  # before the thread baseline: its pool's threads are joined by then
        standby.baseline_threads = native_threads()
        why = fork_unsafe(standby.baseline_threads)
        if why:
            raise RuntimeError(f"after the preload: {why}")
        path = standby.listen()
    except (ImportError, OSError, RuntimeError) as exc:
        write_status(args.job_dir, node, phase="failed", error=str(exc))
        events.emit("standby_failed", level=logging.WARNING, log_dir=args.job_dir, node=node, cause="start",
                    reason=str(exc), action="this node's trainers start cold")
        return 1
    write_status(args.job_dir, node, phase="ready", import_s=round(seconds, 3), modules=len(sys.modules),
                 threads=standby.baseline_threads, socket=str(path))
    events.emit("standby_ready", log_dir=args.job_dir, node=node, import_s=round(seconds, 3),
                modules=len(sys.modules), threads=standby.baseline_threads, copy_method=copy_method,
                calibrate_s=round(calibrate_s, 3), spare=node in spares,
                **({"yielded_s": round(behind.held_s or 0.0, 3)} if behind is not None else {}))
    job = standby.serve()
    if job is None:
        write_status(args.job_dir, node, phase="stopped", served=standby.served, refused=standby.refused)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # not the interpreter's exit: its collections over torch's objects take seconds of CPU
    return run_child(job)


if __name__ == "__main__":
    sys.exit(main())
