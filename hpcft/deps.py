"""Lazy import of optional dependencies with a message that says how to get them."""
import importlib
from types import ModuleType

from hpcft.errors import MissingDependencyError

_HINTS = {
    "mpi4py": "pip install 'hpcft[mpi]' (needs an MPI library, e.g. Debian's libopenmpi-dev)",
    "hip": "pip install 'hpcft[rocm]' (hip-python matching your ROCm version)",
    "crc32c": "pip install crc32c",
    "torch": "pip install torch (on a cluster: your site's ROCm or CUDA build)",
}


def require(module: str, purpose: str) -> ModuleType:
    """Import `module` or raise MissingDependencyError naming what it is needed for and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.split(".")[0]
        hint = _HINTS.get(top, f"pip install {top}")
        raise MissingDependencyError(f"{purpose} needs the Python module '{module}' ({exc}); {hint}") from exc


def available(module: str) -> bool:
    """True when `module` imports; never raises."""
    try:
        importlib.import_module(module)
        return True
    except Exception:
        return False
