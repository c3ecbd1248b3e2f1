"""The rollout-engine interface: what the rollout, the weight sync and the trainer call on an engine.

An engine is a plain class (``ray.remote`` is applied where the engine group is built, ``agent_trainer.workers.build``) that
turns prompt token ids into sampled token ids and their raw logprobs. :class:`RolloutEngine` holds

- the calls every engine answers: ``generate``, ``prompt_logprobs``, ``update_weights``, ``sleep`` / ``wake_up``,
  ``shutdown``, ``intra_op_threads``;
- the engine side of the weight sync (docs/architecture.md, "Weight sync"), one copy for every engine: a sync is a
  session (``begin_weight_sync``, buckets by ``load_weight_bucket`` from the object store, ``receive_weight_bucket``
  over the weight-transfer group or ``load_weight_ipc``, then ``finish_weight_sync``, which checks that every weight
  arrived). By default an engine loads in its own process through :meth:`RolloutEngine.load_tensors`; an engine
  whose model lives elsewhere (vLLM's workers) overrides the per-transport hooks (``_load_packed``,
  ``_join_weight_group``, ``_receive_bucket``, ``_load_ipc``, ``_begin_load``, ``_end_load``);
- what the registry reads before ``ray.init`` (``agent_trainer.checks.engines``): the engine's ``name``, the
  ``actor_rollout_ref.rollout`` keys only it reads (``only_keys``), what it can do (``tensor_parallel``,
  ``request_seeds``), its own start-up check (``check``) and its constructor's keyword arguments
  (``init_kwargs``).

Token in, token out: prompts are token ids and outputs are token ids, never re-tokenized text. Logprobs are the
*raw* model logprobs of each sampled token (``log_softmax`` of the unprocessed logits, the temperature-1
distribution), in float32.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from agent_trainer.workers.sync_transports import join_weight_group, node_ip, rebuild_ipc_tensor, receive_bucket
from agent_trainer.workers.weight_buckets import _aligned, _Packer, bytes_as_tensor, dtype_name, unpack_bucket

DEVICES = ("cpu", "cuda")
FINISH_STOP, FINISH_LENGTH = "stop", "length"


@dataclass
class GenerationOutput:
    """One sampled continuation of one prompt."""

    token_ids: list[int]
    """Generated ids only (no prompt), including the stop/eos token when one ended generation."""
    logprobs: list[float]
    """Raw (temperature-1) float32 model logprob of each token in ``token_ids``."""
    finish_reason: str
    """"stop" (eos or a stop token was generated) or "length" (max_tokens or max_model_len reached)."""


# --------------------------------------------------------------------------- helpers shared by the engines


def _max_new_tokens(prompt_len: int, max_tokens: int, max_model_len: int) -> int:
    """Generation budget of one prompt: ``max_tokens`` capped by the context left."""
    if prompt_len >= max_model_len:
        raise ValueError(
            f"prompt of {prompt_len} tokens does not fit max_model_len={max_model_len}; "
            "shorten the context (ctx_manager) or raise max_model_len"
        )
    return min(max_tokens, max_model_len - prompt_len)


def _check_scoring_lengths(sequences: list[list[int]], max_model_len: int) -> None:
    """``prompt_logprobs`` limit, shared so every engine refuses the same inputs.

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


def _check_device(device: str, enable_sleep_mode: bool) -> None:
    """An engine's device is cpu or cuda; sleep mode needs a GPU (vLLM has none on CPU: refused, not ignored)."""
    if device not in DEVICES:
        raise ValueError(f"rollout engine device = {device!r} must be one of {DEVICES} (agent_trainer.workers.build.resolve_device "
                         "turns trainer.device=auto into one of them)")
    if enable_sleep_mode and device != "cuda":
        raise ValueError("enable_sleep_mode needs a GPU engine (vLLM has no sleep mode on CPU); "
                         "set actor_rollout_ref.rollout.enable_sleep_mode=false on a CPU run")


def _check_sleep_enabled(enabled: bool, call: str) -> None:
    """``sleep``/``wake_up`` on an engine created without sleep mode is a caller's mistake, not a silent no-op."""
    if not enabled:
        raise RuntimeError(f"{call}: this engine was created without enable_sleep_mode (GPU only); the trainer "
                           "calls it only when actor_rollout_ref.rollout.enable_sleep_mode resolves to true")


def tokens_per_second(outputs: list[GenerationOutput], seconds: float) -> float:
    """Generated tokens per wall-clock second (benchmarks and ``perf/`` metrics)."""
    return sum(len(o.token_ids) for o in outputs) / seconds if seconds > 0 else math.inf


# --------------------------------------------------------------------------- the interface


class RolloutEngine:
    """Base class of every rollout engine; subclass it, set ``name``, implement the abstract calls.

    Class attributes read by the registry (``agent_trainer.checks.engines``) before ``ray.init``:
    """

    name: str = ""
    """The engine's registered name (``actor_rollout_ref.rollout.name``)."""
    only_keys: dict[str, str] = {}
    """``actor_rollout_ref.rollout`` keys only this engine reads -> the device it reads them on (cpu | cuda, or
    "" for both). A non-default value of a key some engine claims is refused when the run picks another engine."""
    tensor_parallel: bool = False
    """Splits one engine over ``rollout.tensor_model_parallel_size`` GPUs (else that key must be 1)."""
    request_seeds: bool = False
    """``generate(..., seeds=[...])`` gives each request its own generator (``rollout.mode=async`` needs it)."""

    device: Any = "cpu"
    max_model_len: int = 2048
    sleep_enabled: bool = False
    start_seconds: float = 0.0

    # -- the registry's hooks (class methods: no engine exists yet) ----------------------------------------------
    @classmethod
    def check(cls, cfg) -> None:
        """The engine's own start-up rules on a trainer config, run once before ``ray.init``; raise ValueError with
        one line naming the key, the value and the fix. The base has none."""

    @classmethod
    def init_kwargs(cls, cfg, *, device: str, enable_sleep_mode: bool) -> dict[str, Any]:
        """The constructor's keyword arguments for a run (``agent_trainer.workers.build.build_engines``): the model, the
        resolved device, dtype, context length, seed and sleep mode. An engine that reads more extends them."""
        r = cfg.actor_rollout_ref.rollout
        return {
            "model_path": cfg.actor_rollout_ref.model.path,
            "device": device,
            "dtype": r.dtype or cfg.actor_rollout_ref.model.dtype,
            "max_model_len": r.max_model_len,
            "seed": cfg.trainer.seed,
            "enable_sleep_mode": enable_sleep_mode,
        }

    # -- generation ------------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], *, max_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = -1, stop_token_ids: list[int] | None = None,
                 seed: int | None = None) -> list[GenerationOutput]:
        """Sample one continuation per prompt (token ids in, token ids + raw logprobs out).

        Generation stops at the model's eos, at any of ``stop_token_ids`` (both kept in ``token_ids``), at
        ``max_tokens``, or when the context reaches ``max_model_len``. ``temperature=0`` is greedy. ``seed``
        reseeds the engine for this call. An engine with ``request_seeds`` also takes ``seeds`` (one per prompt).
        """
        raise NotImplementedError(f"{type(self).__name__}.generate")

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """``out[i][t] = log p(seq[t] | seq[:t])`` under the live weights; ``out[i][0] = 0.0``."""
        raise NotImplementedError(f"{type(self).__name__}.prompt_logprobs")

    def intra_op_threads(self) -> int:
        """torch's intra-op threads in this process (``rollout.num_threads``, through OMP_NUM_THREADS)."""
        return torch.get_num_threads()

    # -- memory and lifetime -----------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Free GPU memory between rollouts when colocated (sleep mode); raises without it."""
        _check_sleep_enabled(self.sleep_enabled, "sleep")
        self._sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Reallocate what ``sleep`` freed: ``tags`` among ``weights`` and ``kv_cache`` (None = all)."""
        _check_sleep_enabled(self.sleep_enabled, "wake_up")
        self._wake_up(tags)

    def _sleep(self, level: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no sleep mode")

    def _wake_up(self, tags: list[str] | None) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no sleep mode")

    def shutdown(self) -> None:
        """Stop the engine and undo any process-wide state it left; idempotent. The base holds none."""

    # -- weights: the model this process holds (engines that load in-process) ---------------------------------
    def load_tensors(self, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
        """Copy named tensors (HF names) into the live model, in place."""
        raise NotImplementedError(f"{type(self).__name__}.load_tensors")

    def _expected_weights(self) -> tuple[set[str] | None, set[str]]:
        """(names a full sync must bring, or None when unknown; names it may leave out: a tied ``lm_head``)."""
        return None, set()

    def _weight_dtype(self) -> torch.dtype:
        """The dtype the engine holds its weights in (the sender casts to it)."""
        raise NotImplementedError(f"{type(self).__name__}._weight_dtype")

    def _weight_workers(self) -> int:
        """Processes of this engine that join the weight-transfer group."""
        return 1

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> float:
        """Load HF-named weights (the actor's full state dict) into the live engine; returns seconds."""
        return self.load_full_weights(state_dict)

    # -- the weight sync: what the sender asks -------------------------------------------------------------------
    def weight_sync_info(self) -> dict:
        """The engine's weight dtype and device, its worker count (group ranks) and its current group's name."""
        device = getattr(self, "device", None)  # the engine's device, decided by the caller (cpu | cuda)
        device = getattr(device, "type", device) or ("cuda" if torch.cuda.is_available() else "cpu")
        return {"dtype": dtype_name(self._weight_dtype()), "device": str(device),
                "workers": self._weight_workers(), "weight_group": getattr(self, "_weight_group_name", None)}

    # -- the session -------------------------------------------------------------------------------------------
    def begin_weight_sync(self, tag: str = "") -> None:
        """Open a sync session; ``tag`` names the weights it brings (:meth:`weights_tag` once it finished)."""
        self._sync_tag = tag
        self._sync_received: set[str] = set()
        self._sync_seconds = 0.0
        start = time.perf_counter()
        self._begin_load()
        self._sync_seconds += time.perf_counter() - start

    def _begin_load(self) -> None:
        """Open the engine's load session (nothing for an in-process model)."""

    def _abandon_weight_sync(self) -> None:
        """Close an open load session after a refused bucket (nothing for an in-process model)."""

    def _check_names(self, names: Sequence[str]) -> None:
        expected, optional = self._expected_weights()
        if expected is not None:
            unexpected = sorted(set(names) - expected - optional)
            if unexpected:
                raise ValueError(f"weight sync: names the rollout model does not have {unexpected[:8]}; send the "
                                 "actor's unwrapped HF names (like 'model.layers.0.self_attn.q_proj.weight')")

    def load_weight_bucket(self, bucket: tuple[list, Any]) -> None:
        """object_store: one bucket (specs, flat bytes as a numpy array) from Ray's object store."""
        start = time.perf_counter()
        specs, data = bucket
        names = [s[0] for s in specs]
        try:
            self._check_names(names)
        except ValueError:
            self._abandon_weight_sync()
            raise
        self._load_packed(specs, data)
        self._sync_received.update(names)
        self._sync_seconds += time.perf_counter() - start

    def _load_packed(self, specs: list[list], data) -> None:
        """Load one bucket's bytes (already name-checked)."""
        self.load_tensors(*unpack_bucket(specs, bytes_as_tensor(data)))

    def load_full_weights(self, state_dict: dict[str, torch.Tensor]) -> float:
        """A whole state dict in one session (one bucket on CPU); returns seconds. Names are checked before the
        session opens, so a refused state dict leaves the engine as it was."""
        self._check_names(list(state_dict))
        self.begin_weight_sync()
        packer = _Packer(2**62, sum(_aligned(t.numel() * t.dtype.itemsize) for t in state_dict.values()),
                         torch.device("cpu"))
        for name, tensor in state_dict.items():
            packer.add(name, tensor.detach().cpu(), tensor.dtype)
        if packer.specs:
            bucket = packer.take()
            self.load_weight_bucket((bucket.specs, bucket.flat.numpy()))
        return self.finish_weight_sync()

    def init_weight_group(self, host: str, port: int, rank_offset: int, world_size: int, backend: str, name: str,
                          timeout_s: float) -> None:
        """collective: join the weight-transfer group (every worker of this engine, ranks from ``rank_offset``)."""
        self._join_weight_group(host, port, rank_offset, world_size, backend, name, timeout_s)
        self._weight_group_name = name

    def _join_weight_group(self, host: str, port: int, rank_offset: int, world_size: int, backend: str, name: str,
                           timeout_s: float) -> None:
        self._weight_group = join_weight_group(host, port, rank_offset, world_size, backend, name, timeout_s,
                                               node_ip())

    def receive_weight_bucket(self, specs: list[list]) -> None:
        """collective: receive one bucket from rank 0's broadcast and load it."""
        start = time.perf_counter()
        self._receive_bucket(specs)
        self._sync_received.update(s[0] for s in specs)
        self._sync_seconds += time.perf_counter() - start

    def _receive_bucket(self, specs: list[list]) -> None:
        """Receive (always: rank 0 is broadcasting), then check the names and load."""
        flat = receive_bucket(self._weight_group, specs, torch.device(getattr(self, "device", "cpu")))
        self._check_names([s[0] for s in specs])
        self.load_tensors(*unpack_bucket(specs, flat))

    def load_weight_ipc(self, specs: list[list], handle: list) -> None:
        """cuda_ipc: map the bucket rank 0 holds on this GPU and load from it (GPU only)."""
        start = time.perf_counter()
        self._load_ipc(specs, handle)
        self._sync_received.update(s[0] for s in specs)
        self._sync_seconds += time.perf_counter() - start

    def _load_ipc(self, specs: list[list], handle: list) -> None:
        self._check_names([s[0] for s in specs])
        self.load_tensors(*unpack_bucket(specs, rebuild_ipc_tensor(handle, torch.device(self.device))))

    def finish_weight_sync(self) -> float:
        """Check every weight arrived, finish the engine's load (and reset its prefix cache); returns load seconds."""
        start = time.perf_counter()
        expected, optional = self._expected_weights()
        self._end_load()
        missing = sorted(expected - self._sync_received - optional) if expected is not None else []
        if missing:
            raise ValueError(f"weight sync: the rollout model got no {missing[:8]}{' ...' if len(missing) > 8 else ''}"
                             "; the engine would keep stale weights")
        self._sync_seconds += time.perf_counter() - start
        self._weights_tag = self._sync_tag
        return self._sync_seconds

    def weights_tag(self) -> str:
        """The tag of the last sync this engine finished; "" while it holds the weights it started from. An engine
        Ray restarted between two turns starts from the checkpoint on disk and answers "": the driver compares it
        with the tag it last synced (``agent_trainer.rollout.engines.generate``) and re-syncs instead of sampling
        from stale weights."""
        return getattr(self, "_weights_tag", "")

    def _end_load(self) -> None:
        """Close the engine's load session (nothing for an in-process model)."""
