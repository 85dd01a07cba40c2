"""Training: the loop, its state, the loss, the optimizer, checkpoints, sharding and metrics."""
