"""The typed configuration, the lowest layer of the trainer: every dataclass of the schema and how a config loads.

Modules (each imports only the standard library, omegaconf, yaml and the modules above it in this list):
choices (closed value sets), errors (one-line messages), workers (model, optimizer, FSDP, actor, reference,
rollout, critic sections), envs (``es_manager``), multiturn (seed 004's sections, the context condenser),
rewards (``data``, ``reward``, ``reward_model``, ``judge``, ``reward_computation``), schema (the whole run,
:class:`AgentTrainerConfig`), sft (:class:`SFTConfig`), compat (align-anything / RAGEN keys), loading (merge
onto the schema), docs (the generated pages). The checks of values run above, in ``agent_trainer.checks``.
"""

from agent_trainer.config.loading import config_schema, merge_config, merge_onto_schema, sft_schema
from agent_trainer.config.schema import (
    AgentProxyConfig,
    AgentTrainerConfig,
    AlgorithmConfig,
    CtxManagerConfig,
    DistillConfig,
    EvalConfig,
    GatewayConfig,
    GiGPOConfig,
    KLCtrlConfig,
    McpServerConfig,
    RewardNormalizationConfig,
    RolloutCorrectionConfig,
    TrainerConfig,
    condenser_config,
    keep_last_n,
    rollouts_in_flight,
    split_config,
)
from agent_trainer.config.workers import (
    POLICY_LOSS_DEFAULTS,
    ActorConfig,
    ActorRolloutRefConfig,
    CriticConfig,
    FSDPConfig,
    ModelConfig,
    OptimConfig,
    RefConfig,
    RolloutConfig,
    ValKwargs,
)

__all__ = [
    "POLICY_LOSS_DEFAULTS", "ActorConfig", "ActorRolloutRefConfig", "AgentProxyConfig", "AgentTrainerConfig",
    "AlgorithmConfig", "CriticConfig", "CtxManagerConfig", "DistillConfig", "EvalConfig", "FSDPConfig", "GatewayConfig", "GiGPOConfig", "KLCtrlConfig",
    "McpServerConfig", "ModelConfig", "OptimConfig", "RefConfig", "RewardNormalizationConfig", "RolloutConfig",
    "RolloutCorrectionConfig", "TrainerConfig", "ValKwargs", "condenser_config", "config_schema", "keep_last_n",
    "rollouts_in_flight", "split_config", "merge_config",
    "merge_onto_schema", "sft_schema",
]
