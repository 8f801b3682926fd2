"""What a warm standby's forked child does to become its wrapper's rank: take the wrapper's fds, environment, cwd,
umask, cgroups (its trainer step's cores, memory and devices), CPU affinity, devices, signal mask and ignored signals,
make stdio as the interpreter would, and run the script or module as `python SCRIPT` / `python -m MODULE` would."""
from __future__ import annotations

import io
import os
import runpy
import signal
import socket
import sys
from dataclasses import dataclass

from hpcft.launch.node import cgroups, zygote


@dataclass
class Job:
    """In a forked child: the request it serves, the connection to its wrapper and the wrapper's stdio fds."""

    request: dict
    conn: socket.socket
    fds: list[int]


def _stdio(fd: int, spec: dict, unbuffered: bool, reading: bool) -> io.TextIOWrapper:
    """sys.stdin/stdout/stderr on the wrapper's fd as the interpreter makes them (its buffering, encoding)."""
    write_through = bool(spec.get("write_through")) or (unbuffered and not reading)
    raw = io.FileIO(fd, "rb" if reading else "wb", closefd=False)
    binary = raw if write_through and not reading else (io.BufferedReader(raw) if reading else io.BufferedWriter(raw))
    return io.TextIOWrapper(binary, encoding=spec.get("encoding") or "utf-8", errors=spec.get("errors") or "strict",
                            line_buffering=bool(spec.get("line_buffering")), write_through=write_through)


def _setup(job: Job) -> zygote.Target:
    """Become the wrapper's rank: its cgroups (first: before anything is allocated or opened, and as the cpuset
    move resets the affinity), fds, environment, cwd, umask, CPU affinity, devices, signals, stdio, argv, sys.path."""
    req = job.request
    cgroups.join(req.get("cgroups") or {})
    for target_fd, fd in enumerate(job.fds):
        os.dup2(fd, target_fd)
        os.close(fd)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    os.umask(int(req.get("umask", 0o022)))
    if req.get("affinity"):
        os.sched_setaffinity(0, req["affinity"])
    signals = req.get("signals") or {}
    for sig in signals.get("ignored") or ():
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, signals.get("blocked") or ())
    for device in req.get("devices") or ():
        os.close(os.open(device, os.O_RDWR | os.O_CLOEXEC))
    target = zygote.Target(**{**req["target"], "args": tuple(req["target"]["args"])})
    stdio = req.get("stdio") or {}
    sys.stdin = _stdio(0, stdio.get("stdin") or {}, target.unbuffered, True)
    sys.stdout = _stdio(1, stdio.get("stdout") or {}, target.unbuffered, False)
    sys.stderr = _stdio(2, stdio.get("stderr") or {}, target.unbuffered, False)
    if target.kind == "script":
        sys.argv = [target.name, *target.args]
        sys.path[0] = os.path.dirname(os.path.realpath(target.name))
    else:
        sys.argv = ["-m", *target.args]  # runpy puts the module's path in argv[0], as `python -m` does
        sys.path[0] = os.getcwd()
    return target


def run_child(job: Job) -> int:
    """Set up (refused → the wrapper runs the command cold) and run the target as its own interpreter would."""
    try:
        target = _setup(job)
    except (OSError, KeyError, TypeError, ValueError) as exc:
        zygote.send(job.conn, {"refused": f"setting up the child failed: {type(exc).__name__}: {exc}"})
        os._exit(0)
    zygote.send(job.conn, {"started": os.getpid()})
    job.conn.close()
    try:
        if target.kind == "module":
            runpy.run_module(target.name, run_name="__main__", alter_sys=True)
        elif os.path.isfile(target.name):
            _run_script(target.name)
        else:  # a directory or zip file with a __main__.py
            runpy.run_path(target.name, run_name="__main__")
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:  # noqa: BLE001 - reported as the interpreter would, from the script's frame on
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename in _OWN_FILES:
            tb = tb.tb_next
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)  # the default hook prints exc.__traceback__
        return 1
    return 0


_OWN_FILES = {__file__, runpy.__file__}  # the frames a cold interpreter's traceback would not show


def _run_script(name: str) -> None:
    """Run a script file as the interpreter runs its main script: a fresh `__main__` module, `__file__` joined to
    the cwd as given (not normalised), no spec, its loader a SourceFileLoader."""
    import builtins
    import importlib.machinery
    import types

    path = os.path.join(os.getcwd(), name)
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __cached__=None, __builtins__=builtins, __spec__=None, __package__=None,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", path))
    sys.modules["__main__"] = main
    with open(path, "rb") as fh:
        code = compile(fh.read(), path, "exec")
    exec(code, main.__dict__)
