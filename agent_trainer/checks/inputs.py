"""Start-up checks that read the file system: the env tags file, the tags a config names, the resume folder and
every model's ``config.json`` (its vocabulary, its context length, a reward model's labels). Run by
``agent_trainer.checks.prepare.prepare`` after the config's own checks, still before ``ray.init``.
"""

from __future__ import annotations

from pathlib import Path

from agent_trainer import core_algos
from agent_trainer.checks.distill import check_teacher_vocabulary
from agent_trainer.checks.rl import check_lora_targets
from agent_trainer.config import AgentTrainerConfig
from agent_trainer.config.splits import CONFIG_SPLITS
from envs import load_env_tags

LOCAL_PATH_PREFIXES = ("/", "./", "../", "~", "models/")
"""A model path starting like this is a local folder, never a hub id."""


def check_inputs(cfg: AgentTrainerConfig, env_tags: dict) -> None:
    """Checks that need the file system, the model's config.json or the env tags, still before Ray starts."""
    for split in CONFIG_SPLITS:
        for tag in getattr(cfg.es_manager, split).env_configs.tags:
            if tag not in env_tags:
                raise ValueError(f"es_manager.{split}.env_configs.tags names {tag!r}, which is not a tag in "
                                 f"{cfg.envs_file}; known tags: {sorted(env_tags)}")
    resume = cfg.trainer.resume_from_path
    if resume is not None and not Path(resume).is_dir():
        raise ValueError(f"trainer.resume_from_path = {resume!r} is not a folder; point it at a checkpoint "
                         "folder (<run dir>/global_step_N)")
    model = resolve_model("actor_rollout_ref.model.path", cfg.actor_rollout_ref.model.path)
    check_lora_targets(cfg, model)
    if core_algos.critic_enabled(cfg) and cfg.critic.model.path != cfg.actor_rollout_ref.model.path:
        resolve_model("critic.model.path", cfg.critic.model.path)
    if cfg.reward_model.enable:
        rm_labels = resolve_model("reward_model.model.path", cfg.reward_model.model.path).num_labels
        if rm_labels != 1:
            raise ValueError(f"reward_model.model.path = {cfg.reward_model.model.path!r} has num_labels = {rm_labels}; "
                             "a reward model gives one score per text (AutoModelForSequenceClassification with "
                             "num_labels=1), e.g. models/tiny-qwen2-rm")
    if cfg.algorithm.distill.enable:
        teacher = resolve_model("algorithm.distill.teacher_path", cfg.algorithm.distill.teacher_path)
        check_teacher_vocabulary(cfg, model, teacher)
    text_config = model.get_text_config() if hasattr(model, "get_text_config") else model
    max_positions = getattr(text_config, "max_position_embeddings", None)
    max_model_len = cfg.actor_rollout_ref.rollout.max_model_len
    if isinstance(max_positions, int) and max_model_len > max_positions:
        raise ValueError(f"actor_rollout_ref.rollout.max_model_len = {max_model_len} is more than the model's "
                         f"max_position_embeddings = {max_positions} ({cfg.actor_rollout_ref.model.path}); set "
                         f"actor_rollout_ref.rollout.max_model_len={max_positions} or less")


def resolve_model(key: str, path: str):
    """The model's ``PretrainedConfig``, loaded in the driver: a local folder, or a hub id (hub or cache)."""
    if not path.strip():
        raise ValueError(f"{key} = {path!r} is empty; set model_path to a Hugging Face folder or hub id (org/name)")
    if not Path(path).expanduser().exists():
        if "/" not in path:
            raise ValueError(f"{key} = {path!r} is not a local folder, and a name without 'org/' is not a Hugging "
                             "Face hub id; give the folder's path (e.g. models/tiny-qwen2) or org/name")
        if path.startswith(LOCAL_PATH_PREFIXES) or path.count("/") > 1:
            raise ValueError(f"{key} = {path!r} does not exist; build the tiny model with `make model` "
                             "(python -m launch.build_tiny_model --out models/tiny-qwen2) or set model_path "
                             "to a Hugging Face folder or hub id (org/name)")
    folder = Path(path).expanduser()
    if _adapter_only(folder):
        raise ValueError(f"{key} = {path!r} is a LoRA adapter folder (adapter_config.json, no model weights): set "
                         "model_path to the base model it was trained on and actor_rollout_ref.model.lora_adapter_path "
                         "to this folder, with its lora_rank / lora_alpha / target_modules (docs/lora.md)")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except Exception as err:  # noqa: BLE001 - any failure (missing, offline, malformed) is a config error
        reason = " ".join(f"{type(err).__name__}: {err}".split())[:300]
        raise ValueError(f"{key} = {path!r} cannot be loaded as a Hugging Face model ({reason}); set model_path "
                         "to a folder with a config.json or a reachable (or cached) hub id") from None


def _adapter_only(folder: Path) -> bool:
    """``folder`` holds a peft adapter and no model weights (a LoRA SFT's ``final/``, a LoRA checkpoint's actor)."""
    if not (folder / "adapter_config.json").is_file():
        return False
    return not any(f.name != "adapter_model.safetensors" for f in folder.glob("*.safetensors*"))


def load_envs_file(path: str) -> dict:
    """The env tags of ``envs_file``; a missing or malformed file is a config error naming the key."""
    import yaml

    if not Path(path).is_file():
        raise ValueError(f"envs_file = {path!r} is not a file; point it at a YAML of env tags (like "
                         "config/envs.yaml) or leave it empty for config/envs.yaml")
    try:
        return load_env_tags(path)
    except (ValueError, OSError, ImportError, yaml.YAMLError) as err:
        raise ValueError(f"envs_file = {path!r}: {' '.join(str(err).split())}") from None
