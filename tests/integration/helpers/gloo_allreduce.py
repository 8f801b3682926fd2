"""A task of a sandbox test: one rank of a gloo group across nodes; prints its host and all_reduce sum."""
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from hpcft.env import job_env

env = job_env()
dist.init_process_group(
    "gloo",
    init_method=f"tcp://{env.master_addr}:{env.master_port}",
    rank=env.rank,
    world_size=env.world_size,
    timeout=timedelta(seconds=60),
)
value = torch.tensor([float(env.rank + 1)])
dist.all_reduce(value)
print(f"rank={env.rank} host={socket.gethostname()} master={env.master_addr} sum={value.item():g}", flush=True)
dist.destroy_process_group()
