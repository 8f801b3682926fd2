"""What the unit tests compare a restore by: the live state's tensors, by name, and their bitwise equality."""
import torch

from hpcft.snapshot.state import collect


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """A copy of every tensor a snapshot holds (model and optimizer state), by entry name."""
    return {e.name: e.local.clone() for e in collect(model, opt, None)}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """The same names, and every tensor equal bit for bit."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
