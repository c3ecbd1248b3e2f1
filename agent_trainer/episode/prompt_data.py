"""The prompt-dataset env tags a config's ``data`` section becomes.

``data.train_files`` / ``data.val_files`` are played as episodes of the ``prompt_dataset`` environment
(``envs/dataset_env.py``, which reads them with ``envs.datasets``); this module builds those env tags from
the typed config (their start-up check: ``agent_trainer.checks.datasets``).
"""

from __future__ import annotations

from pathlib import Path

from agent_trainer.config import AgentTrainerConfig
from agent_trainer.config.rewards import TRAIN_TAG, VAL_TAG
from envs.registry import EnvTagConfig


def dataset_env_tags(cfg: AgentTrainerConfig) -> dict:
    """The env tags ``data.train_files`` / ``data.val_files`` become (``prompt_dataset`` episodes).

    ``cfg`` is the typed ``AgentTrainerConfig``. Returns {} when no data files are set; the val tag
    plays ``data.train_files`` when ``data.val_files`` is empty.
    """
    data, fn = cfg.data, cfg.reward.custom_reward_function
    if not data.train_files:
        return {}
    # Absolute paths: env actors are other processes, whose working directory need not be the driver's.
    fn_path = str(Path(fn.path).resolve()) if fn.path else ""
    common = {"prompt_key": data.prompt_key, "ground_truth_key": data.ground_truth_key, "shuffle": data.shuffle,
              "shuffle_seed": cfg.trainer.seed, "reward_fn_path": fn_path, "reward_fn_name": fn.name,
              "max_turns": data.max_turns, "final_marker": data.final_marker}
    files = {TRAIN_TAG: [str(Path(p).resolve()) for p in data.train_files],
             VAL_TAG: [str(Path(p).resolve()) for p in (data.val_files or data.train_files)]}
    return {tag: EnvTagConfig.from_dict(tag, {
        "env_type": "prompt_dataset", "max_actions_per_traj": data.max_turns, "env_instruction": data.instruction,
        "max_tokens": cfg.actor_rollout_ref.rollout.response_length, "env_config": {**common, "files": paths}})
        for tag, paths in files.items()}
