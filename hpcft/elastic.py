"""The training script's side of an elastic shrink (`hpcft run --elastic`): how many micro-batches one optimizer step
takes, and which are this replica's, on fewer data-parallel replicas than the run started with (HPCFT_BASE_WORLD).
HPCFT_ELASTIC_BATCH (`--elastic-batch`) chooses: keep-global (default) deals the starting replicas' micro-batches out
over those left (replica r takes r, r + R, …); sum their losses over the global sample count and all-reduce the
gradients with SUM, and the optimizer sees the same gradient (up to float summation order). keep-per-rank keeps each
replica's micro-batches: the global batch shrinks (scale the learning rate yourself if that matters). Count the data
position in micro-batches consumed, not steps, in the Checkpointer's `extra`: micro-batch i of a step is number
`consumed + i` of the stream on every rank, exact through a reshard."""
from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hpcft.errors import ConfigError

KEEP_GLOBAL, KEEP_PER_RANK = "keep-global", "keep-per-rank"
ENV_BATCH = "HPCFT_ELASTIC_BATCH"
ENV_BASE_WORLD = "HPCFT_BASE_WORLD"


@dataclass(frozen=True)
class BatchPlan:
    """One optimizer step's micro-batches across replicas (pure data; see the module doc)."""
    mode: str            # keep-global | keep-per-rank
    base_replicas: int   # data-parallel replicas the run started with
    replicas: int        # data-parallel replicas now
    replica: int         # this replica's index (ctx.dp_rank)
    per_replica: int = 1  # micro-batches each replica took per step at the start

    @property
    def micro_batches(self) -> int:
        """Micro-batches in one optimizer step, over all replicas."""
        return self.per_replica * (self.base_replicas if self.mode == KEEP_GLOBAL else self.replicas)

    def mine(self) -> range:
        """Indices (within the step) of this replica's micro-batches."""
        return range(self.replica, self.micro_batches, self.replicas)

    @property
    def accumulation(self) -> int:
        """The most micro-batches any replica accumulates per step (what sets the step's time)."""
        return math.ceil(self.micro_batches / self.replicas)


def batch_plan(ctx: Any, per_replica: int = 1, environ: Mapping[str, str] | None = None) -> BatchPlan:
    """The plan for this rank of `ctx` (hpcft.init()'s Context: `world`, `dp`, `dp_rank`): without --elastic the
    job runs as it started (base = now)."""
    env = os.environ if environ is None else environ
    mode = env.get(ENV_BATCH) or KEEP_GLOBAL
    if mode not in (KEEP_GLOBAL, KEEP_PER_RANK):
        raise ConfigError(f"{ENV_BATCH}={mode!r} is not a batch policy; choose {KEEP_GLOBAL} or {KEEP_PER_RANK}")
    if per_replica < 1:
        raise ConfigError(f"per_replica must be at least 1 (got {per_replica})")
    per_dp = ctx.world // ctx.dp  # ranks per replica (tensor, pipeline parallel)
    try:
        base_world = int(env.get(ENV_BASE_WORLD) or ctx.world)
    except ValueError:
        raise ConfigError(f"{ENV_BASE_WORLD}={env.get(ENV_BASE_WORLD)!r} is not an integer") from None
    if base_world % per_dp:
        raise ConfigError(f"{ENV_BASE_WORLD}={base_world} is not a multiple of the {per_dp} ranks of a replica")
    return BatchPlan(mode, base_world // per_dp, ctx.dp, ctx.dp_rank, per_replica)
