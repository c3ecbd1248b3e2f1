"""LoRA on the FSDP2 actor (``actor_rollout_ref.model.lora_rank`` > 0), with ``peft``.

The adapter is injected into the Hugging Face model in place (``peft.inject_adapter_in_model``): the model stays
a ``Qwen2ForCausalLM`` (its config, output head and decoder layers where the workers look for them), each targeted
``nn.Linear`` becomes a peft ``lora.Linear`` holding the frozen original as ``base_layer`` and the trained
``lora_A`` [r, in] / ``lora_B`` [out, r] of the adapter ``default``. Parameter names change accordingly::

    model.layers.0.self_attn.q_proj.weight  ->  model.layers.0.self_attn.q_proj.base_layer.weight   (frozen)
                                                model.layers.0.self_attn.q_proj.lora_A.default.weight (trained)
                                                model.layers.0.self_attn.q_proj.lora_B.default.weight (trained)

Only the ``lora_A`` / ``lora_B`` parameters require gradients, so the optimizer holds them alone. The module's
output is ``x W^T + (alpha / r) (x A^T) B^T``; :func:`merged_weight` is the matrix the engines get instead
(``W + (alpha / r) B A``, under the plain name: :func:`sync_name`). The reference policy is the same model with the
adapter switched off (:func:`adapter_disabled`). A checkpoint holds the adapter in peft's own layout
(:func:`write_adapter`: ``adapter_config.json`` + ``adapter_model.safetensors``, keys
``base_model.model.<module>.lora_A.weight``), which ``peft.PeftModel.from_pretrained`` loads onto the base model.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Iterator

import torch

from agent_trainer.config import ModelConfig

ADAPTER = "default"
"""The one adapter's name inside the model (peft's default; it is left out of the checkpoint's keys)."""

ALL_LINEAR = "all-linear"
"""``target_modules: [all-linear]``: every ``nn.Linear`` of the decoder (not the output head), peft's shorthand."""


def lora_config(model: ModelConfig):
    """peft's ``LoraConfig`` for ``model``'s ``lora_*`` keys (``lora_rank`` > 0)."""
    from peft import LoraConfig

    targets = list(model.target_modules)
    return LoraConfig(r=model.lora_rank, lora_alpha=model.lora_alpha, lora_dropout=model.lora_dropout,
                      target_modules=ALL_LINEAR if targets == [ALL_LINEAR] else targets, bias="none",
                      task_type="CAUSAL_LM")


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """The distinct last name parts of ``model``'s ``nn.Linear`` modules but the output head (what
    ``target_modules`` may name: the engines tie the head to the embeddings, so it is not adapted)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, torch.nn.Linear) and module is not head})


def check_targets(model: torch.nn.Module, targets: list[str]) -> None:
    """Refuse ``target_modules`` entries that name no ``nn.Linear`` of ``model`` (one line, naming the model's)."""
    if list(targets) == [ALL_LINEAR]:
        return
    known = linear_module_names(model)
    unknown = [t for t in targets if t not in known]
    if unknown or not targets:
        raise ValueError(f"actor_rollout_ref.model.target_modules = {list(targets)}: {unknown or 'nothing'} matches "
                         f"no linear module of {type(model).__name__} (its linear modules: {known}); name some of "
                         f"those, or [{ALL_LINEAR}]")


def add_adapter(model: torch.nn.Module, cfg: ModelConfig) -> torch.nn.Module:
    """Inject ``cfg``'s LoRA adapter into ``model`` in place and freeze everything else; returns ``model``.

    On the meta device the adapter's weights are meta too: :func:`initial_adapter_weights` fills them after the
    model is materialised (:meth:`agent_trainer.workers.fsdp_base.FSDPWorker.load_pretrained`)."""
    from peft import inject_adapter_in_model

    check_targets(model, list(cfg.target_modules))
    inject_adapter_in_model(lora_config(cfg), model, adapter_name=ADAPTER)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_tensor(name))
    if not any(is_adapter_tensor(name) for name, _ in model.named_parameters()):
        raise ValueError(f"actor_rollout_ref.model.target_modules = {list(cfg.target_modules)} put no adapter into "
                         f"{type(model).__name__} (its linear modules: {linear_module_names(model)})")
    return model


def has_adapter(model: torch.nn.Module | None) -> bool:
    """Whether ``model`` carries a LoRA adapter (:func:`add_adapter`)."""
    return model is not None and any(True for _ in lora_layers(model))


def lora_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """(module name, peft LoRA layer) of every adapted module."""
    from peft.tuners.lora import LoraLayer

    return ((name, module) for name, module in model.named_modules() if isinstance(module, LoraLayer))


def is_adapter_tensor(name: str) -> bool:
    """Whether a parameter name belongs to the adapter (``...lora_A.default.weight``)."""
    return ".lora_A." in name or ".lora_B." in name or ".lora_embedding_" in name or ".lora_magnitude" in name


def sync_name(name: str) -> str:
    """The plain Hugging Face name of a base parameter: ``...q_proj.base_layer.weight`` -> ``...q_proj.weight``."""
    return name.replace(".base_layer.", ".")


def adapted_module_name(name: str) -> str | None:
    """``...q_proj`` for a base weight ``...q_proj.base_layer.weight``; None for any other name."""
    suffix = ".base_layer.weight"
    return name[: -len(suffix)] if name.endswith(suffix) else None


def merged_weight(layer: torch.nn.Module, base: torch.Tensor) -> torch.Tensor:
    """``W + (alpha / r) B A`` for the unsharded ``base`` weight of ``layer`` (its ``lora_A``/``lora_B`` gathered
    too, as they share its FSDP unit), computed in float32, returned in ``base``'s dtype."""
    a = layer.lora_A[ADAPTER].weight
    b = layer.lora_B[ADAPTER].weight
    delta = (b.float() @ a.float()) * layer.scaling[ADAPTER]
    return (base.float() + delta).to(base.dtype)


@contextlib.contextmanager
def adapter_disabled(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block ``model`` computes without its adapter: the base model, i.e. the reference policy (peft's
    ``disable_adapter()``, per layer, as the model is not a ``PeftModel``). Adapter parameters keep their
    ``requires_grad``."""
    layers = [module for _, module in lora_layers(model)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def initial_adapter_weights(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Fresh adapter weights for ``model`` (names as in its state dict, full shapes, on CPU): ``lora_A`` as peft
    initialises it (Kaiming-uniform, a = sqrt(5)) from a generator seeded with ``seed``, ``lora_B`` zeros (the
    adapted model starts as the base model). Rank 0 builds them and broadcasts them into the shards."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, param in model.named_parameters():
        if not is_adapter_tensor(name):
            continue
        value = torch.zeros(param.shape, dtype=param.dtype)
        if ".lora_A." in name:
            bound = 1.0 / math.sqrt(param.shape[1])  # kaiming_uniform_(a=sqrt(5)) on fan_in = shape[1]
            value.uniform_(-bound, bound, generator=generator)
        weights[name] = value
    return weights


def base_weight_names(model: torch.nn.Module) -> dict[str, str]:
    """{name in a Hugging Face checkpoint: name in ``model``} for the base weights an adapter moved under
    ``base_layer`` (``q_proj.weight`` -> ``q_proj.base_layer.weight``)."""
    return {sync_name(name): name for name, _ in model.named_parameters() if ".base_layer." in name}


# --------------------------------------------------------------------------- peft's checkpoint layout

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_key(name: str) -> str:
    """A model's adapter parameter name as peft saves it: ``base_model.model.`` in front, the adapter name out."""
    return "base_model.model." + name.replace(f".{ADAPTER}.", ".")


def write_adapter(shards: Path, out: Path, cfg: ModelConfig) -> Path:
    """``adapter_config.json`` and ``adapter_model.safetensors`` in ``out``, assembled from a sharded checkpoint's
    ``shards`` (which hold the adapter only), one full tensor at a time; ``PeftModel.from_pretrained(base, out)``
    loads them."""
    from agent_trainer.workers import sharded_checkpoint as sc

    index = sc.read_index(shards)
    reader = sc.ShardReader(shards, index)
    entries = {entry["key"]: entry for key, entry in index["tensors"].items()
               if key.startswith("model/") and is_adapter_tensor(entry["key"])}
    specs = [(peft_key(name), tuple(entry["shape"]), sc.dtype_of(entry["dtype"])) for name, entry in entries.items()]
    by_peft = {peft_key(name): entry for name, entry in entries.items()}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sc.write_safetensors(out / ADAPTER_WEIGHTS, specs, lambda key: reader.rows(by_peft[key]), {"format": "pt"})
    config = lora_config(cfg)
    config.base_model_name_or_path = cfg.path
    config.save_pretrained(str(out))  # adapter_config.json, as peft writes it
    return out / ADAPTER_WEIGHTS


def model_key(peft_name: str) -> str:
    """The model's adapter parameter name for a name peft saved (the inverse of :func:`peft_key`):
    ``base_model.model.<module>.lora_A.weight`` -> ``<module>.lora_A.default.weight``."""
    name = peft_name.removeprefix("base_model.model.")
    for part in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector"):
        name = name.replace(f".{part}.", f".{part}.{ADAPTER}.")
        if name.endswith(f".{part}"):
            name = f"{name}.{ADAPTER}"
    return name


def read_adapter(folder: str | Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``folder``'s ``adapter_model.safetensors`` (a peft adapter folder: an SFT's ``final/``, a checkpoint's
    ``actor``, any ``save_pretrained`` of a ``PeftModel``) under ``model``'s adapter parameter names, in their dtype,
    on CPU. Its tensors must be exactly ``model``'s adapter, same shapes (else ValueError, one line, naming some)."""
    from safetensors.torch import load_file

    expected = {name: param for name, param in model.named_parameters() if is_adapter_tensor(name)}
    saved = load_file(str(Path(folder) / ADAPTER_WEIGHTS))
    weights = {model_key(name): value for name, value in saved.items()}
    where = f"actor_rollout_ref.model.lora_adapter_path = {str(folder)!r}"
    missing, extra = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or extra:
        raise ValueError(f"{where}: its {ADAPTER_WEIGHTS} does not fit this run's adapter (missing "
                         f"{[peft_key(n) for n in missing[:4]]}, unexpected {[peft_key(n) for n in extra[:4]]}); "
                         "set lora_rank / lora_alpha / target_modules as the adapter was trained")
    for name, value in weights.items():
        if tuple(value.shape) != tuple(expected[name].shape):
            raise ValueError(f"{where}: {peft_key(name)} has shape {list(value.shape)}, this run's adapter "
                             f"{list(expected[name].shape)}; set lora_rank as the adapter was trained")
    return {name: value.to(expected[name].dtype) for name, value in weights.items()}


def starting_adapter_weights(model: torch.nn.Module, cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """The adapter's first weights: ``cfg.lora_adapter_path``'s (:func:`read_adapter`) when set, else fresh ones
    seeded with ``seed`` (:func:`initial_adapter_weights`)."""
    if cfg.lora_adapter_path:
        return read_adapter(cfg.lora_adapter_path, model)
    return initial_adapter_weights(model, seed)
