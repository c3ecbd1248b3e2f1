"""Env actors: ``EnvStateManager`` hosted in a Ray actor.

Each actor holds a shard of episodes (give it whole groups so pass@group is
local); the rollout calls ``reset.remote(seeds)``, ``step.remote(inputs)`` and
``get_rollout_states.remote()``. Environments are pure Python and light, so an
actor reserves a fraction of a CPU: on a 2-core machine the trainer and the
rollout engine keep the cores. Override per call site with
``EnvWorker.options(num_cpus=...)``.
"""

import ray

from agent_trainer.episode.es_manager import EnvStateManager

EnvWorker = ray.remote(num_cpus=0.1)(EnvStateManager)
