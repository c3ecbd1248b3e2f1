"""The rollout engines under their former names: ``workers.engines`` holds them now (the interface in
``workers.engines.base``, one module per engine). ``VLLMRolloutWorker`` is :class:`workers.engines.vllm.VLLMEngine`
and ``HFRolloutWorker`` :class:`workers.engines.hf.HFEngine`; the helpers are re-exported as they were."""

from __future__ import annotations

from workers.engines.base import (
    DEVICES,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationOutput,
    RolloutEngine,
    _check_device,
    _check_scoring_lengths,
    _check_sleep_enabled,
    _check_weight_names,
    _checkpoint_shapes,
    _checkpoint_weight_names,
    _max_new_tokens,
    checkpoint_parameters,
    tokens_per_second,
)
from workers.engines.hf import HFEngine
from workers.engines.vllm import CPU_ENGINE_ENV, CPU_MAX_NUM_BATCHED_TOKENS, ROLLOUT_OUTPUTS, VLLMEngine, engine_args

VLLMRolloutWorker = VLLMEngine
HFRolloutWorker = HFEngine

__all__ = [
    "CPU_ENGINE_ENV", "CPU_MAX_NUM_BATCHED_TOKENS", "DEVICES", "FINISH_LENGTH", "FINISH_STOP", "ROLLOUT_OUTPUTS",
    "GenerationOutput", "HFEngine", "HFRolloutWorker", "RolloutEngine", "VLLMEngine", "VLLMRolloutWorker",
    "_check_device", "_check_scoring_lengths", "_check_sleep_enabled", "_check_weight_names", "_checkpoint_shapes",
    "_checkpoint_weight_names", "_max_new_tokens", "checkpoint_parameters", "engine_args", "tokens_per_second",
]
