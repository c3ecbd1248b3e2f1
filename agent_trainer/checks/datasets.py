"""Start-up check of ``data.train_files`` / ``data.val_files`` (the prompt-dataset env tags of
``agent_trainer.episode.prompt_data``): before Ray starts, every file and the reward function load once."""

from __future__ import annotations

from typing import Callable

from agent_trainer.config import AgentTrainerConfig
from agent_trainer.config.rewards import TRAIN_TAG, VAL_TAG
from envs.datasets import check_prompt_lengths, load_prompts
from envs.reward_fns import load_reward_fn


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
