"""The checkpointing a user would write without hpcft (torch.save/torch.load, torch.distributed.checkpoint), as a
careful user does and no more; DCP calls need a process group (`harness.local_process_group`)."""
from __future__ import annotations

import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from hpcft.bench.model import Trainer

#: The form of async_save the snapshot bench uses (see /work/shared/TORCH-NOTES.md): the thread
#: executor on the default process group crashes under gloo, so the save gets its own gloo group.
DCP_ASYNC_FORM = "dcp.async_save, thread executor, own gloo process group, default stager (blocking CPU copy)"

# The benches rotate between two checkpoint dirs; DCP warns on every overwrite, which is intended here.
warnings.filterwarnings("ignore", message="Detected an existing checkpoint", category=UserWarning)


def torch_save(trainer: Trainer, path: Path) -> None:
    """torch.save of model and optimizer state dicts to one file."""
    torch.save({"model": trainer.model.state_dict(), "optim": trainer.optimizer.state_dict()}, path)


def torch_load(trainer: Trainer, path: Path) -> None:
    """torch.load (weights only) and load_state_dict into the live model and optimizer."""
    state = torch.load(path, weights_only=True)
    trainer.model.load_state_dict(state["model"])
    trainer.optimizer.load_state_dict(state["optim"])


def _dcp_state(trainer: Trainer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
    return {"model": model_sd, "optim": optim_sd}


def dcp_save(trainer: Trainer, path: Path) -> None:
    """Synchronous torch.distributed.checkpoint.save of model and optimizer to a directory."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_dcp_state(trainer), checkpoint_id=str(path))


def dcp_async_save(trainer: Trainer, path: Path, process_group: Any) -> Future:
    """Start dcp.async_save (thread executor) on its own process group; the caller waits on the future."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    return dcp.async_save(_dcp_state(trainer), checkpoint_id=str(path), process_group=process_group,
                          async_checkpointer_type=AsyncCheckpointerType.THREAD)


def dcp_load(trainer: Trainer, path: Path) -> None:
    """torch.distributed.checkpoint.load into the live state dicts, then set_state_dict."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _dcp_state(trainer)
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
