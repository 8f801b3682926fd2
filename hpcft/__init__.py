"""hpcft: fault-tolerant hybrid-parallel training on Slurm with in-memory checkpointing.

The training-side API (`init`, `Checkpointer` and its `Options`, `restartable`) is imported lazily so that the CLI
and the cluster tools start without importing torch.
"""
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "init": ("hpcft.runtime", "init"),
    "Context": ("hpcft.runtime", "Context"),
    "Checkpointer": ("hpcft.checkpointer", "Checkpointer"),
    "Options": ("hpcft.options", "Options"),
    "batch_plan": ("hpcft.elastic", "batch_plan"),
    "restartable": ("hpcft.inprocess.wrapper", "restartable"),
    "Attempt": ("hpcft.inprocess.wrapper", "Attempt"),
    "RestartOptions": ("hpcft.inprocess.policy", "RestartOptions"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'hpcft' has no attribute {name!r}")
