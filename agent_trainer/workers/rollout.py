"""The rollout engines under their former names: ``agent_trainer.workers.engines`` holds them now (the interface in
``agent_trainer.workers.engines.base``, one module per engine). ``VLLMRolloutWorker`` is
:class:`agent_trainer.workers.engines.vllm.VLLMEngine` and ``HFRolloutWorker``
:class:`agent_trainer.workers.engines.hf.HFEngine`; the helpers still imported from here are re-exported."""

from __future__ import annotations

from agent_trainer.workers.engines.base import GenerationOutput, checkpoint_parameters, tokens_per_second
from agent_trainer.workers.engines.hf import HFEngine
from agent_trainer.workers.engines.vllm import CPU_ENGINE_ENV, ROLLOUT_OUTPUTS, VLLMEngine, engine_args

VLLMRolloutWorker = VLLMEngine
HFRolloutWorker = HFEngine

__all__ = ["CPU_ENGINE_ENV", "ROLLOUT_OUTPUTS", "GenerationOutput", "HFRolloutWorker", "VLLMRolloutWorker",
           "checkpoint_parameters", "engine_args", "tokens_per_second"]
