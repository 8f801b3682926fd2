"""The task wrapper's warm path: the node's standby forks the rank, the wrapper stands in for it towards srun (stdio
passed over, signals forwarded, ending as the rank did; the standby kills a rank whose wrapper died). Else None with a
`<role>_start how=cold` event, and the wrapper execs the command (agents too: `role="agent"`, node/handoff.py)."""
from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import sys
import time
from collections.abc import Mapping, Sequence

from hpcft import events
from hpcft.errors import HpcftError
from hpcft.launch.node import cgroups, zygote

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT)
START_TIMEOUT_S = 60.0  # fork and set-up take milliseconds; a standby this slow is treated as absent


def _stdio_spec() -> dict:
    """How srun's fds became this interpreter's stdio, for the child to make its own as a cold `python` would."""
    spec = {}
    for name in ("stdin", "stdout", "stderr"):
        stream = getattr(sys, name)
        spec[name] = {"encoding": getattr(stream, "encoding", None), "errors": getattr(stream, "errors", None),
                      "line_buffering": getattr(stream, "line_buffering", False),
                      "write_through": getattr(stream, "write_through", False)}
    return spec


def request(target: zygote.Target, environ: Mapping[str, str], blocked: set[int]) -> dict:
    """What the standby needs to become this rank (`blocked`: this process's signal mask, as exec would keep it)."""
    return {"python": sys.executable, "target": {**target.__dict__, "args": list(target.args)}, "env": dict(environ),
            "cwd": os.getcwd(), "umask": _umask(), "cgroups": cgroups.own(),  # its step's: the child joins them
            "affinity": sorted(os.sched_getaffinity(0)), "devices": zygote.reachable_devices(), "stdio": _stdio_spec(),
            "signals": {"blocked": sorted(int(s) for s in blocked), "ignored": _ignored()}}


def _ignored() -> list[int]:
    """The signals ignored here (exec keeps them ignored: `nohup`'s SIGHUP, a background job's SIGINT)."""
    return sorted(int(s) for s in signal.valid_signals() if signal.getsignal(s) is signal.SIG_IGN)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _who(environ: Mapping[str, str]) -> dict[str, str | None]:
    return {"rank": environ.get("HPCFT_RANK"), "node": environ.get("HPCFT_NODE_NAME") or environ.get("SLURMD_NODENAME")}


def _cold(why: str, environ: Mapping[str, str], role: str) -> None:
    # a trainer started cold is time lost; an agent of the first launch usually starts before the standbys are up
    events.emit(f"{role}_start", level=logging.WARNING if role == "trainer" else logging.INFO, how="cold",
                **_who(environ), reason=why, action="a new interpreter starts (the standby is on)")


def run(command: Sequence[str], environ: Mapping[str, str], role: str = "trainer") -> int | None:
    """Run `command` in the node's standby: its exit status (a signal death re-raised here), or None to run it cold."""
    if environ.get(zygote.ENV_STANDBY) != "1":
        return None
    target, why = zygote.target_of(command, sys.executable, environ.get("PATH"))
    if target is None or (target.kind == "script" and not os.path.exists(target.name)):
        _cold(why or f"no script {target.name!r} (the interpreter says why)", environ, role)
        return None
    started = time.monotonic()
    # a signal srun sends before the forwarding is in place (the rank may already run) waits for it, not kills us
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    try:
        path = zygote.socket_path(environ.get("HPCFT_JOB_ID", "local"), environ.get("HPCFT_STORE_ROOT") or None)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        sock.settimeout(START_TIMEOUT_S)
        sock.connect(str(path))
        if zygote.peer_uid(sock) != os.getuid():
            raise zygote.ProtocolError(f"the process listening at {path} is not of uid {os.getuid()}")
        zygote.send(sock, request(target, environ, blocked), fds=(0, 1, 2))
        reply, _ = zygote.receive(sock)
    except (OSError, HpcftError) as exc:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)  # the cold exec inherits the mask as it was
        _cold(f"no standby answered: {type(exc).__name__}: {exc}", environ, role)
        return None
    if reply is None or "started" not in reply:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        sock.close()  # the standby kills a child whose wrapper is gone
        _cold(f"the standby refused: {(reply or {}).get('refused', 'it closed the connection')}", environ, role)
        return None
    events.emit(f"{role}_start", how="warm", **_who(environ), pid=reply["started"],
                seconds=round(time.monotonic() - started, 3))
    return _wait(sock, blocked)


def run_or_exec(command: Sequence[str], environ: Mapping[str, str], role: str = "trainer") -> int:
    """`run` in the standby; where it cannot, exec `command` in place of this process (127 if it cannot start)."""
    code = run(command, environ, role)
    if code is not None:
        return code
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"hpcft {role}: cannot run {command[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127


def _wait(sock: socket.socket, blocked: set[int]) -> int:
    """Forward signals to the rank until it ends; end as it did."""
    sock.settimeout(None)

    def forward(signum: int, _frame) -> None:
        with contextlib.suppress(OSError):
            zygote.send(sock, {"signal": signum})

    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    for sig in FORWARDED:
        signal.signal(sig, forward)
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)  # what came meanwhile is forwarded now
    try:
        reply, _ = _reply(sock, wake_r)
    except (OSError, HpcftError) as exc:
        reply = None
        print(f"hpcft task: the standby connection failed: {exc}", file=sys.stderr)
    finally:
        signal.set_wakeup_fd(-1)
        os.close(wake_r)
        os.close(wake_w)
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_DFL)
    if reply is None:
        print("hpcft task: the standby ended before this rank's process (it dies with the standby)", file=sys.stderr)
        return 1
    if "signal" in reply:
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(reply["signal"], signal.SIG_DFL)
        os.kill(os.getpid(), reply["signal"])
        return 128 + reply["signal"]
    return int(reply.get("exit", 1))


def _reply(sock: socket.socket, wake: int) -> tuple[dict | None, list[int]]:
    """The standby's reply, waiting on the socket and the signals' wakeup fd: Python runs a handler only between
    bytecodes, so a signal that lands just before a blocking recvmsg would be forwarded only once the rank ended."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    poller.register(wake, select.POLLIN)
    while True:
        ready = dict(poller.poll())
        if wake in ready:
            zygote.drain(wake)
        if sock.fileno() in ready:
            return zygote.receive(sock)
