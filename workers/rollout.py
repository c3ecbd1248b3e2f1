"""The rollout engines under their former names: ``workers.engines`` holds them now (the interface in
``workers.engines.base``, one module per engine). ``VLLMRolloutWorker`` is :class:`workers.engines.vllm.VLLMEngine`
and ``HFRolloutWorker`` :class:`workers.engines.hf.HFEngine`; the helpers still imported from here are re-exported."""

from __future__ import annotations

from workers.engines.base import GenerationOutput, checkpoint_parameters, tokens_per_second
from workers.engines.hf import HFEngine
from workers.engines.vllm import CPU_ENGINE_ENV, ROLLOUT_OUTPUTS, VLLMEngine, engine_args

VLLMRolloutWorker = VLLMEngine
HFRolloutWorker = HFEngine

__all__ = ["CPU_ENGINE_ENV", "ROLLOUT_OUTPUTS", "GenerationOutput", "HFRolloutWorker", "VLLMRolloutWorker",
           "checkpoint_parameters", "engine_args", "tokens_per_second"]
