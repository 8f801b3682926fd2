"""RNG states (torch CPU and device, Python, NumPy) as JSON, and back."""
import base64
import random
from typing import Any

import numpy as np
import torch

from hpcft.errors import ManifestError


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _tensor(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def grab() -> tuple:
    """Every generator a training step may draw from, as copies taken now (tens of microseconds: at the snapshot
    boundary, on the training thread); `encode` makes them JSON later, off that thread."""
    device = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    # legacy=False: the dict form costs a third of the tuple form; set_state takes either
    return torch.get_rng_state(), random.getstate(), np.random.get_state(legacy=False), device


def encode(grabbed: tuple) -> dict[str, Any]:
    """`grab()`'s states in a JSON-able dict (what manifests record and `restore` reads)."""
    cpu, (version, state, gauss), nps, device = grabbed
    keys = np.ascontiguousarray(nps["state"]["key"]).view(np.uint8)
    out = {"torch": _b64(cpu), "python": [version, list(state), gauss],
           "numpy": ["MT19937", _b64(torch.from_numpy(keys)), int(nps["state"]["pos"]), int(nps["has_gauss"]),
                     float(nps["gauss"])]}
    if device is not None:
        out["device"] = [_b64(s) for s in device]
    return out


def _decode(saved: dict[str, Any]) -> tuple:
    """`encode`'s dict as the states the generators take: torch CPU, Python, NumPy, the devices' (or None)."""
    version, state, gauss = saved["python"]
    kind, keys, pos, has_gauss, cached = saved["numpy"]
    return (_tensor(saved["torch"]), (version, tuple(state), gauss),
            (kind, _tensor(keys).numpy().view(np.uint32).copy(), pos, has_gauss, cached),
            [_tensor(s) for s in saved["device"]] if "device" in saved else None)


def check(saved: Any) -> None:
    """ManifestError unless `saved` is a state `restore` can apply: each part is set on a scratch generator of its
    kind, which validates it the way the global one would (checked before a restore loads anything)."""
    try:
        cpu, py, nps, _ = _decode(saved)
        torch.Generator().set_state(cpu)
        random.Random().setstate(py)
        np.random.RandomState().set_state(nps)
    except (KeyError, TypeError, ValueError, RuntimeError, OverflowError, IndexError) as exc:
        raise ManifestError(f"the manifest's RNG state cannot be restored ({type(exc).__name__}: {exc})") from exc


def restore(saved: dict[str, Any]) -> None:
    """Set every generator to the captured state (checked by `check` first)."""
    cpu, py, nps, device = _decode(saved)
    torch.set_rng_state(cpu)
    random.setstate(py)
    np.random.set_state(nps)
    if device is not None and torch.cuda.is_available() and len(device) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(device)
