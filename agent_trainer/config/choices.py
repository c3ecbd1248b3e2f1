"""The closed sets of values single config keys take (checked before ``ray.init`` by ``agent_trainer.checks``).

Choices that name a function registered by an algorithm (estimators, losses, KL penalties) live with
those functions in ``agent_trainer.core_algos``.
"""

DTYPES = ("float32", "bfloat16", "float16")
LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
RESUME_MODES = ("auto", "disable", "resume_path")
RECOMPUTE_OLD_LOG_PROB = ("auto", "always")
ROLLOUT_MODES = ("sync", "async")
ASYNC_MODES = ("buffered", "continuous")
"""``trainer.async_mode``: when the engines take new weights under ``trainer.max_off_policy_steps`` >= 1."""
REFILL_UNITS = ("rollout", "group")
"""``trainer.refill``: what the continuous producer starts again when it ends, a whole rollout or one group."""
FILTER_GROUPS_METRICS = ("reward", "success")
"""``algorithm.filter_groups.metric``: what must differ within a group for it to be trained (DAPO's dynamic
sampling): the episodes' rewards as trained on, or the env's success flag."""
STALE_GROUP_POLICIES = ("drop", "replace")
"""``trainer.stale_groups``: what happens to a group older than the staleness bound."""
"""actor_rollout_ref.rollout.mode: turn-synchronous, or no barrier between turns (agent_trainer.rollout)."""
MIXED_PRECISIONS = ("none", "bf16")
"""*.fsdp.mixed_precision: float32 throughout, or FSDP2's MixedPrecisionPolicy to bfloat16 (agent_trainer.workers.fsdp_base)."""
CTX_MODES = ("full", "condensed")
"""ctx_manager.mode: one row per episode, or one row per turn with a condensed prompt."""
LR_SCHEDULERS = ("constant", "cosine")
"""*.optim.lr_scheduler_type: the learning rate after the warm-up (agent_trainer.workers.fsdp_base)."""
DATA_SOURCES = ("demonstrations", "jsonl")
"""SFT data.source."""
THINK_MODES = ("plain", "note")
"""``data.think`` of an SFT run's demonstrations: the template think, or a copy of the env's note/observation."""
WEIGHT_SYNC_TRANSPORTS = ("auto", "object_store", "collective", "cuda_ipc")
"""actor_rollout_ref.rollout.weight_sync (the same tuple as agent_trainer.workers.sync_transports.TRANSPORTS; a test keeps them
equal)."""
