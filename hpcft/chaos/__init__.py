"""`hpcft chaos`: goodput under a stream of mixed faults in the sandbox (docs/results.md, "Goodput under faults")."""
