"""The Hugging Face rollout engine: transformers ``generate``; the fallback engine, and the faster one for tiny
models on CPU, where vLLM's per-step overhead dominates. It has no per-request seeds (``rollout.mode=async`` needs
the vLLM engine) and no tensor parallelism; it loads the weight sync's buckets in its own process.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from agent_trainer.workers.engines.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationOutput,
    RolloutEngine,
    _check_device,
    _check_scoring_lengths,
    _check_weight_names,
    _max_new_tokens,
)


class HFEngine(RolloutEngine):
    """Rollout with transformers ``generate`` (the interface of
    :class:`agent_trainer.workers.engines.base.RolloutEngine`)."""

    name = "hf"

    def __init__(self, model_path: str, *, device: str = "cpu", dtype: str = "float32", max_model_len: int = 2048,
                 kv_cache_space_gib: float = 1.0, seed: int = 0, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.5, enable_sleep_mode: bool = False,
                 max_batch_size: int = 64):
        """Load ``model_path`` with ``AutoModelForCausalLM`` on ``device`` (cpu | cuda, the caller's decision).

        ``kv_cache_space_gib`` and ``gpu_memory_utilization`` are accepted so
        either backend takes the same config, and are unused here.
        ``enable_sleep_mode`` moves the model to CPU RAM in ``sleep`` (GPU only; refused on CPU).
        ``max_batch_size`` bounds how many prompts one ``generate`` call pads together.
        """
        from transformers import AutoConfig, AutoModelForCausalLM

        if tensor_parallel_size != 1:
            raise ValueError(
                f"the hf engine runs one device per worker (tensor_parallel_size={tensor_parallel_size}); "
                "use the vllm engine for tensor parallelism or set tensor_parallel_size=1"
            )
        _check_device(device, enable_sleep_mode)
        # The GPU Ray gave this actor is device 0 of its CUDA_VISIBLE_DEVICES.
        self.device = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        self.max_model_len = max_model_len
        self.max_batch_size = max_batch_size
        self.sleep_enabled = enable_sleep_mode
        torch.manual_seed(seed)
        start = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        self.model.to(self.device).eval()
        self.start_seconds = time.perf_counter() - start
        config = AutoConfig.from_pretrained(model_path)
        gen = self.model.generation_config
        eos = gen.eos_token_id if gen.eos_token_id is not None else config.eos_token_id
        self.eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        pad = gen.pad_token_id if gen.pad_token_id is not None else config.pad_token_id
        self.pad_id = pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], *, max_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = -1, stop_token_ids: list[int] | None = None,
                 seed: int | None = None) -> list[GenerationOutput]:
        """Sample one continuation per prompt; see ``RolloutEngine.generate``."""
        if seed is not None:
            torch.manual_seed(seed)
        stops = set(self.eos_ids) | set(stop_token_ids or [])
        budgets = [_max_new_tokens(len(p), max_tokens, self.max_model_len) for p in prompts]
        # Similar lengths share a padded batch; results go back in the caller's order.
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        results: list[GenerationOutput | None] = [None] * len(prompts)
        for first in range(0, len(order), self.max_batch_size):
            chunk = order[first : first + self.max_batch_size]
            outs = self._generate_batch([prompts[i] for i in chunk], max(budgets[i] for i in chunk),
                                        temperature, top_p, top_k, sorted(stops))
            for i, (ids, logprobs) in zip(chunk, outs):
                results[i] = self._finish(ids, logprobs, budgets[i], stops)
        return results

    def _generate_batch(self, prompts, max_new_tokens, temperature, top_p, top_k, stops):
        """Left-padded ``generate`` returning (ids, raw logprobs) per prompt, padding included."""
        from transformers import GenerationConfig

        width = max(map(len, prompts))
        input_ids = torch.tensor([[self.pad_id] * (width - len(p)) + list(p) for p in prompts], device=self.device)
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        sample = temperature > 0
        # A fresh config: the checkpoint's own sampling defaults (e.g. Qwen's repetition_penalty)
        # must not apply, so both backends sample from the same distribution.
        config = GenerationConfig(
            max_new_tokens=max_new_tokens, do_sample=sample, eos_token_id=stops, pad_token_id=self.pad_id,
            # output_logits are the raw logits (before temperature/top-k/top-p processors).
            return_dict_in_generate=True, output_logits=True,
            **(dict(temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else 0) if sample else {}),
        )
        out = self.model.generate(input_ids=input_ids, attention_mask=attention, generation_config=config)
        new = out.sequences[:, width:]
        logits = torch.stack(out.logits, dim=1).float()  # [B, T_new, V]
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        return list(zip(new.tolist(), logprobs.tolist()))

    @staticmethod
    def _finish(ids: list[int], logprobs: list[float], budget: int, stops: set[int]) -> GenerationOutput:
        """Cut the padded row after its first stop token (kept) or at its own budget."""
        for t, tok in enumerate(ids[:budget]):
            if tok in stops:
                return GenerationOutput(ids[: t + 1], logprobs[: t + 1], FINISH_STOP)
        return GenerationOutput(ids[:budget], logprobs[:budget], FINISH_LENGTH)

    @torch.no_grad()
    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """``out[i][t] = log p(seq[t] | seq[:t])``; ``out[i][0] = 0.0`` (one right-padded forward)."""
        _check_scoring_lengths(sequences, self.max_model_len)
        results = []
        for first in range(0, len(sequences), self.max_batch_size):
            chunk = sequences[first : first + self.max_batch_size]
            width = max(map(len, chunk))
            ids = torch.tensor([list(s) + [self.pad_id] * (width - len(s)) for s in chunk], device=self.device)
            mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in chunk], device=self.device)
            logits = self.model(input_ids=ids, attention_mask=mask).logits.float()
            lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
            results += [[0.0] + lp[row, : len(s) - 1].tolist() for row, s in enumerate(chunk)]
        return results

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> float:
        """Copy HF-named weights into the model in place; returns seconds taken."""
        start = time.perf_counter()
        expected = set(self.model.state_dict())
        tied = {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()
        _check_weight_names(expected, set(state_dict), optional=tied)
        self.model.load_state_dict(state_dict, strict=False)
        return time.perf_counter() - start

    def _sleep(self, level: int) -> None:
        """Move the model to CPU RAM (sleep mode, GPU only; raises without it, as vLLM's engine does)."""
        self.model.to("cpu")
        torch.cuda.empty_cache()

    def _wake_up(self, tags: list[str] | None) -> None:
        """Move the model back to the GPU after ``sleep`` (any tag wakes the weights; there is no KV cache to keep)."""
        if tags is None or "weights" in tags:
            self.model.to(self.device)

    # -- the weight sync: in this process ---------------------------------------------------------------------
    def _weight_dtype(self) -> torch.dtype:
        return self.model.dtype

    def _expected_weights(self) -> tuple[set[str] | None, set[str]]:
        tied = {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()
        return set(self.model.state_dict()), tied

    def load_tensors(self, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
        """Copy in place (a tied ``lm_head`` follows its embeddings)."""
        with torch.no_grad():
            targets = dict(self.model.named_parameters(remove_duplicate=False))
            targets.update(self.model.named_buffers())
            for name, tensor in zip(names, tensors):
                targets[name].copy_(tensor)
