"""What the supervisor watches while training runs: stragglers, nodes returned for a grow."""
