"""In-process restart (`hpcft.restartable`): a training function re-run in the same processes after a fault that left
them alive, its process groups made anew and its state restored from node memory."""
