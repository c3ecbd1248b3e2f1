"""Plain helpers of every layer above: the training batch, checkpoint files, the plug-in registry, trajectory
profiling, the prompt format."""
