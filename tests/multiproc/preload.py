"""What every rank of a scenario imports, imported once in launch.py's fork server: torch, the compiler stack that
the first optimizer lazily imports (torch._dynamo, sympy: 2-3 s of CPU alone), the distributed pieces and hpcft.
A rank forked from there starts in a fraction of a second instead of paying ≈ 5 s of CPU for its imports."""
import numpy  # noqa: F401
import torch  # noqa: F401
import torch._dynamo  # noqa: F401
import torch.distributed  # noqa: F401
import torch.distributed.device_mesh  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.tensor  # noqa: F401

import hpcft  # noqa: F401
