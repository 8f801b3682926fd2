"""The durable tier: snapshots flushed from the node stores to a persistent directory in
torch.distributed.checkpoint's layout (readable by plain `dcp.load` at any world size), and read back by hpcft
with resharding. See docs/reference/durable.md for the on-disk format."""
