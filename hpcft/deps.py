"""Lazy import of optional dependencies with a message that says how to get them."""
import importlib
from types import ModuleType

from hpcft.errors import MissingDependencyError

_HINTS = {
    "mpi4py": "pip install 'hpcft[mpi]' (needs an MPI library, e.g. Debian's libopenmpi-dev)",
    "hip": "pip install 'hpcft[rocm]' (hip-python matching your ROCm version)",
    "crc32c": "pip install crc32c",
    "matplotlib": "pip install 'hpcft[plots]'",
    "transformers": "pip install 'hpcft[examples]'",
    "torch": "pip install torch (on a cluster: your site's ROCm or CUDA build)",
}


def hint(module: str) -> str:
    """How to install what provides `module`: the one place every message about a missing dependency takes it from."""
    top = module.split(".")[0]
    return _HINTS.get(top, f"pip install {top}")


def missing(module: str, purpose: str, exc: ImportError) -> MissingDependencyError:
    """The error for `purpose` lacking `module`: what it is needed for and how to install it, in one line."""
    return MissingDependencyError(f"{purpose} needs the Python module '{module}' ({exc}); {hint(module)}")


def require(module: str, purpose: str) -> ModuleType:
    """Import `module` or raise MissingDependencyError naming what it is needed for and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise missing(module, purpose, exc) from exc


def available(module: str) -> bool:
    """True when `module` imports; never raises."""
    try:
        importlib.import_module(module)
        return True
    except Exception:
        return False
