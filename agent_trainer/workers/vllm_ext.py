"""The vLLM worker extension: the engine-side methods the rollout calls by name.

``vllm.LLM(..., worker_extension_cls="agent_trainer.workers.vllm_ext.RolloutWorkerExtension")`` mixes this class into
every vLLM worker process, so ``llm.collective_rpc("reseed", args=(seed,))`` runs ``reseed`` on each of
them. Calls go by method name, never as Python functions: vLLM's multiprocess client (the default on
GPUs, ``VLLM_ENABLE_V1_MULTIPROCESSING=1``) sends them through its msgpack encoder, which refuses
functions; names, numbers, strings, bytes, lists and tensors it encodes.

The weight sync (``agent_trainer.workers.weight_sync``) loads a sync's buckets in one session of vLLM's layerwise
reload: ``begin_bucketed_load`` once, ``load_weight_bucket`` / ``receive_weight_bucket`` /
``load_ipc_weight_bucket`` per bucket, ``end_bucketed_load`` once. A layer is processed as soon as all of
its weights have arrived, so a bucket boundary may split a fused layer (q/k/v, gate/up) without harm.
Method names here must not collide with vLLM's ``Worker`` (it has ``update_weights``,
``start_weight_update``, ``finish_weight_update`` of its own).
"""

from __future__ import annotations

from typing import Sequence

import torch

EXTENSION = "agent_trainer.workers.vllm_ext.RolloutWorkerExtension"
"""The ``worker_extension_cls`` the rollout engines are created with."""


class RolloutWorkerExtension:
    """Methods added to vLLM's ``Worker`` (``self`` is the worker: ``self.model_runner``, ``self.reload_weights``)."""

    def reseed(self, seed: int) -> None:
        """Reseed this worker's global torch generator (requests without their own seed sample from it)."""
        torch.manual_seed(seed)

    # -- the bucketed weight sync ---------------------------------------------------------
    def begin_bucketed_load(self) -> None:
        """Open a load session: vLLM's layerwise reload buffers each layer's weights until it has them all."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.get_model())

    def load_weight_bucket(self, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
        """Load one bucket of checkpoint-format (HF-named) weights inside the open session."""
        from vllm.config import set_current_vllm_config

        weights = list(zip(names, tensors))
        hf_config = self.vllm_config.model_config.hf_config
        if getattr(hf_config, "tie_word_embeddings", False) and "lm_head.weight" not in names:
            # The sync sends a tied weight once; the layerwise reload counts the LM head as a layer of its own and,
            # without its weight, puts the old values back into it ("ParallelLMHead: Failed to load weights").
            weights += [("lm_head.weight", t) for n, t in weights if n == "model.embed_tokens.weight"]
        with set_current_vllm_config(self.vllm_config):
            self.model_runner.get_model().load_weights(weights)

    def load_packed_bucket(self, specs: list[list], data) -> None:
        """Load one bucket given as its flat bytes (bytes or a buffer) and specs (``agent_trainer.workers.weight_buckets.Bucket``).

        Bytes, not tensors: vLLM's multiprocess client decodes a call's arguments without their types, and a
        tensor arrives as a list; bytes and lists arrive as they were sent.
        """
        from agent_trainer.workers.weight_buckets import bytes_as_tensor, unpack_bucket

        names, tensors = unpack_bucket(specs, bytes_as_tensor(data))
        self.load_weight_bucket(names, tensors)

    def end_bucketed_load(self) -> None:
        """Close the session (layers not yet processed are processed now) and drop state derived from the old
        weights, as ``reload_weights`` does."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        runner = self.model_runner
        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(runner.get_model(), self.vllm_config.model_config)
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            if hasattr(runner, reset):
                getattr(runner, reset)()

    def init_weight_group(self, host: str, port: int, rank_offset: int, world_size: int, backend: str, name: str,
                          timeout_s: float) -> None:
        """Join the weight-transfer group as rank ``rank_offset + self.rank`` (rank 0 is the actor's rank 0)."""
        from agent_trainer.workers.sync_transports import join_weight_group, node_ip

        old = getattr(self, "_weight_group", None)
        self._weight_group = None
        del old
        self._weight_group = join_weight_group(host, port, rank_offset + int(self.rank), world_size, backend, name,
                                               timeout_s, node_ip() if backend == "gloo" else None)

    def receive_weight_bucket(self, specs: list[list], load: bool = True) -> None:
        """Receive one bucket from rank 0's broadcast and (``load``) load it inside the open session."""
        from agent_trainer.workers.sync_transports import receive_bucket
        from agent_trainer.workers.weight_buckets import unpack_bucket

        device = getattr(self, "device", None) or torch.device("cpu")
        flat = receive_bucket(self._weight_group, specs, device)
        if load:
            self.load_weight_bucket(*unpack_bucket(specs, flat))

    def load_ipc_weight_bucket(self, specs: list[list], handle: list) -> None:
        """Map the bucket rank 0 holds on this GPU (CUDA IPC) and load it; GPU only, never run on CPU."""
        from agent_trainer.workers.sync_transports import rebuild_ipc_tensor
        from agent_trainer.workers.weight_buckets import unpack_bucket

        shared = rebuild_ipc_tensor(handle, torch.cuda.current_device())
        # A copy: the layerwise reload keeps a layer's tensors until the layer is complete, possibly after rank 0
        # has reused its buffer for the next bucket.
        flat = shared.clone()
        torch.cuda.synchronize()
        del shared
        self.load_weight_bucket(*unpack_bucket(specs, flat))

    def close_weight_group(self) -> None:
        """Drop the weight-transfer group."""
        self._weight_group = None
