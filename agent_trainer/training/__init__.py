"""The fit loop (``AgentTrainer``) and what it runs on the driver: reward-model scoring, colocation, the run's
lifecycle, the memory plan."""
