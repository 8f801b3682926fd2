"""What the task wrapper and a node's warm standby (hpcft/launch/node/standby.py) share: where the standby listens, one
message (JSON, with file descriptors) on a SOCK_SEQPACKET unix socket, the peer's uid, and which commands a standby
can run (pure: `python[3] SCRIPT ARGS` or `python -m MODULE ARGS` with the wrapper's own interpreter)."""
from __future__ import annotations

import array
import contextlib
import json
import os
import shutil
import socket
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hpcft.errors import HpcftError
from hpcft.store.paths import job_dir, resolve_root

ENV_STANDBY = "HPCFT_WARM"  # "1": the supervisor runs a standby on every node of the job (the wrapper tries it)
MAX_MESSAGE = 1 << 20  # one request: argv, the environment, cwd; a SOCK_SEQPACKET message arrives whole
MAX_FDS = 3
# Device nodes a GPU task opens: a standby child must reach the ones its wrapper reaches (a step's device cgroup)
DEVICE_GLOBS = ("/dev/kfd", "/dev/dri/renderD*", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia[0-9]*")


class ProtocolError(HpcftError):
    """A standby connection broke the protocol (a peer of another user, a malformed message, a closed socket)."""


def socket_dir(job_id: str, root: str | os.PathLike | None = None, user: str | None = None) -> Path:
    """`<store root>/.standby-hpcft-<user>-<job>`, 0700, beside the store (which a shrink wipes under a standby)."""
    base = resolve_root(root)
    return base / f".standby-{job_dir(base, job_id, user).name}"


def socket_path(job_id: str, root: str | os.PathLike | None = None) -> Path:
    return socket_dir(job_id, root) / "sock"


def send(sock: socket.socket, message: Mapping, fds: Sequence[int] = ()) -> None:
    """One message, with `fds` passed along (SCM_RIGHTS)."""
    data = json.dumps(message).encode()
    if len(data) > MAX_MESSAGE:
        raise ProtocolError(f"standby message of {len(data)} bytes is over {MAX_MESSAGE}")
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sock.sendmsg([data], ancillary)


def receive(sock: socket.socket) -> tuple[dict | None, list[int]]:
    """(message, fds received with it); (None, []) when the peer closed the connection."""
    data, ancillary, flags, _ = sock.recvmsg(MAX_MESSAGE, socket.CMSG_SPACE(MAX_FDS * 4))
    fds: list[int] = []
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got = array.array("i")
            got.frombytes(payload[:len(payload) - len(payload) % got.itemsize])
            fds.extend(got)
    truncated, message = flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC), None
    if data and not truncated:
        with contextlib.suppress(ValueError):
            message = json.loads(data)
    if isinstance(message, dict):
        return message, fds
    for fd in fds:
        os.close(fd)
    if truncated or data:
        raise ProtocolError("standby message truncated" if truncated else "standby message is not a JSON object")
    return None, []


def drain(fd: int) -> None:
    """Read a non-blocking signal wakeup pipe empty (signal.set_wakeup_fd: it only wakes a wait)."""
    with contextlib.suppress(BlockingIOError):
        while os.read(fd, 512):
            pass


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end (SO_PEERCRED: the kernel's word, not the peer's)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


@dataclass(frozen=True)
class Target:
    """What a standby child runs: a script (`python SCRIPT`) or a module (`-m MODULE`), its argv tail, and `-u`."""

    kind: str  # "script" | "module"
    name: str
    args: tuple[str, ...]
    unbuffered: bool = False


def same_interpreter(candidate: str, python: str) -> bool:
    """The same interpreter as `python`: the same path, or the same real binary in the same directory (a venv's
    `python3` beside its `python`; a venv's binary links to the system one, so the directory tells venvs apart)."""
    a, b = os.path.abspath(candidate), os.path.abspath(python)
    return a == b or (os.path.dirname(a) == os.path.dirname(b) and os.path.realpath(a) == os.path.realpath(b))


def target_of(command: Sequence[str], python: str, path: str | None) -> tuple[Target | None, str]:
    """(the Target, "") when a standby can run `command` as `python` would, else (None, why); `path`: its PATH."""
    if not command:
        return None, "no command"
    exe = shutil.which(command[0], path=path) if os.sep not in command[0] else command[0]
    if exe is None or not same_interpreter(exe, python):
        return None, f"{command[0]!r} is not the interpreter the standby runs ({python})"
    rest, unbuffered = list(command[1:]), False
    while rest and rest[0] == "-u":
        rest, unbuffered = rest[1:], True
    if not rest:
        return None, "no script (an interactive interpreter)"
    if rest[0] == "-m":
        if len(rest) < 2 or rest[1].startswith("-"):
            return None, "-m without a module name"
        return Target("module", rest[1], tuple(rest[2:]), unbuffered), ""
    if rest[0].startswith("-"):
        return None, f"interpreter option {rest[0]!r} (a standby runs `python [-u] SCRIPT|-m MODULE ARGS` only)"
    return Target("script", rest[0], tuple(rest[1:]), unbuffered), ""


def reachable_devices(globs: Sequence[str] = DEVICE_GLOBS) -> list[str]:
    """The GPU device nodes this process can open (read-write, closed again at once)."""
    import glob

    found = []
    for pattern in globs:
        for path in sorted(glob.glob(pattern)):
            try:
                os.close(os.open(path, os.O_RDWR | os.O_CLOEXEC))
            except OSError:
                continue
            found.append(path)
    return found


# Variables read when the interpreter or its libraries start (the standby read them at its own start): a task whose
# value differs would not get what a cold start gives it
IMPORT_TIME = ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "PYTHONNOUSERSITE", "PYTHONUSERBASE", "PYTHONHASHSEED",
               "PYTHONWARNINGS", "PYTHONDEVMODE", "PYTHONOPTIMIZE", "LD_PRELOAD", "LD_LIBRARY_PATH")
IMPORT_TIME_PREFIXES = ("OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_")


def env_mismatch(task: Mapping[str, str], standby: Mapping[str, str]) -> str | None:
    """The first import-time variable whose value differs between the task's environment and the standby's, or None."""
    names = set(IMPORT_TIME) | {k for k in (*task, *standby) if k.startswith(IMPORT_TIME_PREFIXES)}
    for name in sorted(names):
        if task.get(name) != standby.get(name):
            return name
    return None
