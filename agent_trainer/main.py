"""Hydra entry point: ``python -m agent_trainer.main --config-name frozenlake key=value ...``.

The config is merged onto the typed schema and validated before Ray starts;
``ray.init()`` starts a local cluster, or joins ``RAY_ADDRESS`` when it is set
(``ray job submit`` sets it).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from agent_trainer.config import AgentTrainerConfig, load_config

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parents[1] / "config"

# base.yaml lists this schema first in its defaults, so every typed key can be overridden
# without "+" and hydra rejects unknown keys while composing.
ConfigStore.instance().store(name="agent_trainer_schema", node=AgentTrainerConfig)


def check_inputs(cfg: AgentTrainerConfig, env_tags: dict) -> None:
    """Checks that need the file system or the env registry, still before any worker starts."""
    for path_key, path in (("actor_rollout_ref.model.path", cfg.actor_rollout_ref.model.path),
                           ("critic.model.path", cfg.critic.model.path)):
        if not Path(path).exists() and "/" in path and path.startswith((".", "/", "models")):
            raise ValueError(f"{path_key} = {path!r} does not exist; build the tiny model with "
                             "`make model` (python -m launch.build_tiny_model --out models/tiny-qwen2) "
                             "or set model_path to a Hugging Face folder")
    for split in ("train", "val"):
        for tag in getattr(cfg.es_manager, split).env_configs.tags:
            if tag not in env_tags:
                raise ValueError(f"es_manager.{split}.env_configs.tags names {tag!r}, which is not a tag in "
                                 f"{cfg.envs_file}; known tags: {sorted(env_tags)}")


def init_ray(cfg: AgentTrainerConfig) -> None:
    """Start a local Ray cluster, or join the one in ``RAY_ADDRESS``."""
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init()  # joins the cluster in RAY_ADDRESS (set for drivers started by `ray job submit`)
    else:
        ray.init(num_cpus=cfg.trainer.ray_num_cpus, include_dashboard=False, log_to_driver=True)


def prepare(raw_cfg: DictConfig | dict) -> tuple[AgentTrainerConfig, dict]:
    """Validate the config and the env tags (raises ValueError naming the key and the fix)."""
    from envs import load_env_tags

    cfg = load_config(raw_cfg)
    if not cfg.envs_file:
        cfg.envs_file = str(CONFIG_DIR / "envs.yaml")
    env_tags = load_env_tags(cfg.envs_file)
    check_inputs(cfg, env_tags)
    return cfg, env_tags


def train(cfg: AgentTrainerConfig, env_tags: dict) -> list[dict[str, float]]:
    """Start Ray and the workers, train; return every step's metrics."""
    from transformers import AutoTokenizer

    from agent_trainer.trainer import AgentTrainer

    init_ray(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.actor_rollout_ref.model.path)
    trainer = AgentTrainer(cfg, tokenizer, env_tags)
    Path(cfg.trainer.default_local_dir).mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.structured(cfg), Path(cfg.trainer.default_local_dir) / "config.yaml")
    trainer.init_workers()
    return trainer.fit()


@hydra.main(version_base=None, config_path="../config", config_name="frozenlake")
def main(cfg: DictConfig) -> None:
    """Console entry point (hydra parses ``--config-name`` and ``key=value`` overrides)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        typed, env_tags = prepare(cfg)
    except ValueError as err:
        # Config errors: one clear line, no traceback wall.
        raise SystemExit(f"agent-trainer: {err}") from None
    train(typed, env_tags)


if __name__ == "__main__":
    main()
