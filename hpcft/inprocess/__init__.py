"""In-process restart: a training function re-run in the same processes after a fault that left them alive (an
exception in one rank, a collective error or timeout), its process groups made anew and its state restored from
node memory. The torch-free parts (policy, record) import without torch; the wrapper is `hpcft.restartable`."""
