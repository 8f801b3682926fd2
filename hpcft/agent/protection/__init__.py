"""What the agents do over the transport: placement, erasure codes, protect, rebuild, flush."""
