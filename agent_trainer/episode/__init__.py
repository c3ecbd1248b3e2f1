"""One episode's env state (the env-state manager), the prompt-dataset env tags, and the driver's per-episode logic
on the batch (rollout shaping, template-collapse metrics)."""
