"""Every start-up check of a config, run once before ``ray.init``: cross-field rules, closed choices, and the
names of registered plug-ins (estimators, condensers, reward computers, agents) looked up in their registries.

Above the schema (``agent_trainer.config``) and the code whose registries it consults; below the rollout,
the workers and the entry points. ``load.load_config`` / ``load.load_sft_config`` merge and check in one call;
``prepare`` (a layer above the others: it runs the memory plan's and the placement's checks too) is the one loader
of every entry point and runs every start-up check in order.
"""
