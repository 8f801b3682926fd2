"""The local Slurm sandbox: a real slurmctld and N real slurmd on this machine (see docs/reference/sandbox.md)."""
from hpcft.sandbox.cluster import Sandbox, ensure_up
from hpcft.sandbox.config import SandboxConfig, default_dir

__all__ = ["Sandbox", "SandboxConfig", "default_dir", "ensure_up"]
