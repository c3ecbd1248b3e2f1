"""The prompt-dataset env tags a config's ``data`` section becomes, and their start-up check.

``data.train_files`` / ``data.val_files`` are played as episodes of the ``prompt_dataset`` environment
(``envs/dataset_env.py``, which reads them with ``envs.datasets``); this module builds those env tags from
the typed config and, before Ray starts, loads every file and the reward function once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from agent_trainer.config import AgentTrainerConfig
from agent_trainer.config.rewards import TRAIN_TAG, VAL_TAG
from envs.datasets import check_prompt_lengths, load_prompts
from envs.registry import EnvTagConfig
from envs.reward_fns import load_reward_fn


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


def check_datasets(cfg: AgentTrainerConfig, env_tags: dict, count_tokens: Callable[[str], int]) -> None:
    """Before Ray starts: every data file loads, every prompt fits data.max_prompt_length, the reward fn loads.

    Errors name the key (or the file and line) and the fix.
    """
    data = cfg.data
    for tag, key in ((TRAIN_TAG, "data.train_files"), (VAL_TAG, "data.val_files")):
        if tag not in env_tags:
            continue
        env_cfg = env_tags[tag].env_config
        try:
            records = load_prompts(env_cfg["files"], data.prompt_key, data.ground_truth_key)
        except ValueError as err:
            raise ValueError(f"{key}: {err}") from None
        check_prompt_lengths(records, count_tokens, data.max_prompt_length)
    fn = cfg.reward.custom_reward_function
    load_reward_fn(fn.path, fn.name)
