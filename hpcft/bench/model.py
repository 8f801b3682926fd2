"""A plain-torch GPT-style transformer and its AdamW training step: the workload every bench times; `--params 50M`
is the reference model of PERFORMANCE-NOTES.md (8 layers, d_model 640, 10 heads, seq 256, batch 4, vocab 8192)."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hpcft.errors import ConfigError

#: Below this many parameters the bench uses a short, narrow shape so a smoke run takes seconds.
SMALL_MODEL_PARAMS = 5_000_000


@dataclass(frozen=True)
class ModelConfig:
    """The shape of the bench transformer and its batch."""

    layers: int
    d_model: int
    heads: int
    seq: int
    batch: int
    vocab: int


def config_for_params(params: int, batch: int | None = None) -> ModelConfig:
    """The shape whose parameter count is closest to `params`, with d_model a multiple of the head width;
    `batch` (sequences per step) replaces the shape's default, e.g. to give a GPU a realistic step."""
    if params < 100_000:
        raise ConfigError(f"--params {params} is too small; use at least 100k (e.g. 1M for a smoke run)")
    if params < SMALL_MODEL_PARAMS:
        layers, seq, default_batch, vocab, head_dim = 2, 64, 2, 1024, 32
    else:
        layers, seq, default_batch, vocab, head_dim = 8, 256, 4, 8192, 64
    # Solve layers*12 d² + (13 layers + 2 vocab + seq + 2) d = params for d (a block: qkv 3d²+3d, proj d²+d, mlp
    # 8d²+5d, two LayerNorms 4d; untied embedding and head, positions, final LayerNorm), then round to whole heads.
    a, b = 12 * layers, 13 * layers + 2 * vocab + seq + 2
    d_exact = (-b + math.sqrt(b * b + 4 * a * params)) / (2 * a)
    heads = max(1, round(d_exact / head_dim))
    return ModelConfig(layers=layers, d_model=heads * head_dim, heads=heads, seq=seq,
                       batch=default_batch if batch is None else batch, vocab=vocab)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4× GELU MLP."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token and position embeddings, `layers` blocks, a final LayerNorm and an untied LM head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.heads) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class Trainer:
    """A model, its AdamW optimizer and a few fixed random batches; `step()` runs one training step."""

    def __init__(self, cfg: ModelConfig, seed: int = 0, n_batches: int = 4, device: str = "cpu") -> None:
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        self.cfg = cfg
        self.device = torch.device(device)
        self.model = GPT(cfg).to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.batches = [torch.randint(cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen).to(self.device)
                        for _ in range(n_batches)]
        self.steps_done = 0

    def step(self) -> float:
        """Forward, backward and optimizer step on the next batch; returns the loss (on a GPU, reading it
        waits for the step's kernels, so a timed step is the whole step)."""
        tokens = self.batches[self.steps_done % len(self.batches)]
        logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_done += 1
        return float(loss.detach())

    def checkpointer(self, root: str | os.PathLike, job_id: str = "bench") -> Any:
        """hpcft's Checkpointer of this model as the benches take it: a snapshot every step, two kept, each at an
        explicit `step(it)` (auto=False), so that the trainer's steps in other variants take none."""
        from hpcft.checkpointer import Checkpointer
        from hpcft.options import Options

        return Checkpointer(self.model, self.optimizer, Options(every=1, keep=2, root=str(root), job_id=job_id,
                                                                auto=False))

    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor of the training state: parameters and optimizer moments/step counters."""
        tensors = [p.detach() for p in self.model.parameters()]
        for state in self.optimizer.state.values():
            tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        return tensors

    def state_bytes(self) -> int:
        """Bytes of the training state (what a snapshot must copy)."""
        return sum(t.numel() * t.element_size() for t in self.state_tensors())
