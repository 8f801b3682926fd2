"""The node agent: cross-node protection of committed snapshots (placement, codecs, transport, protect pass)."""
