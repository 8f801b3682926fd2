"""Tearing down a generation's process groups after a fault. gloo: a rank's sockets close (making a peer's blocked
collective raise) only when its groups are freed, not on destroy or abort while anything refers to them (torch
2.13), so the fault's traceback frames (the training function's locals) are cleared. NCCL/RCCL: a blocked collective
waits on the device, so the communicators are aborted, from the watcher thread too."""
from __future__ import annotations

import logging
import traceback

import torch
import torch.distributed as dist

from hpcft.snapshot import groups

_log = logging.getLogger(__name__)


def on_device() -> bool:
    """Whether the default group runs NCCL/RCCL communicators (which only an abort interrupts)."""
    if not dist.is_initialized() or not torch.cuda.is_available():
        return False
    try:
        return "nccl" in dist.get_backend_config()
    except (RuntimeError, ValueError):
        return False


def interrupt() -> None:
    """From the watcher thread: abort NCCL/RCCL communicators so the training thread's collective returns."""
    if on_device():
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception as exc:  # noqa: BLE001 - the teardown that follows tries again
            _log.warning("aborting the NCCL/RCCL communicators failed: %s", exc)


def release(exc: BaseException | None) -> None:
    """Drop what the fault's tracebacks hold (the frames' locals), its causes' and contexts' too."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def teardown(exc: BaseException | None = None) -> str | None:
    """Abort (NCCL/RCCL) or destroy (gloo) every process group of this generation, forget hpcft's CPU groups and free
    what the fault held (`release(exc)`); an error text if that failed (the next generation may not form groups)."""
    groups.forget()
    release(exc)
    broken = None
    if dist.is_initialized():
        try:
            if on_device():
                dist.distributed_c10d._abort_process_group()
            else:
                dist.destroy_process_group()
        except Exception as err:  # noqa: BLE001 - reported: the give-up decision needs it
            broken = f"{type(err).__name__}: {err}"
    return broken
