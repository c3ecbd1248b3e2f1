"""What a run shows: metric sinks and the phase timer, live metrics, trajectory records and their viewer, worker
logs."""
