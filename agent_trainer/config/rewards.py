"""Config of prompt datasets and reward sources (verl's ``data``, ``reward`` sections).

Imported by ``agent_trainer.config`` (the sections of :class:`AgentTrainerConfig`); the
validation rules live in ``agent_trainer.config_checks``, the dataset env tags they
become are built by :func:`agent_trainer.datasets.dataset_env_tags`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TRAIN_TAG = "PromptData"
"""The env tag ``data.train_files`` becomes (name it in ``es_manager.train.env_configs.tags``)."""
VAL_TAG = "PromptDataVal"
"""The env tag ``data.val_files`` becomes (name it in ``es_manager.val.env_configs.tags``)."""


@dataclass
class DataConfig:
    """Prompt datasets (verl's ``data`` section), played as episodes of the ``prompt_dataset`` env."""

    train_files: list[str] = field(default_factory=list)
    """Training data: JSON, JSONL, TXT (one prompt a line) or parquet files, or RAGEN split folders holding
    prompts.json. Non-empty = the env tag PromptData exists (use it in es_manager.train.env_configs.tags)."""
    val_files: list[str] = field(default_factory=list)
    """Validation data, same formats; the env tag PromptDataVal (empty = validate on train_files' rows)."""
    prompt_key: str = "prompt"
    """Row field holding the prompt: plain text or chat messages ([{role, content}, ...])."""
    ground_truth_key: str = "reward_model.ground_truth"
    """Dotted path of a row's ground truth (verl's parquet rows); rows without it have none."""
    max_prompt_length: int = 1024
    """Longest prompt in tokens (the policy's tokenizer, prompt text only); a longer row is refused at start-up
    naming its file and line (policy: error; shorten the row or raise this)."""
    shuffle: bool = True
    """Walk each epoch in a random order seeded by trainer.seed (else file order)."""
    max_turns: int = 1
    """Turns per question: 1 = single-turn (the first answer is scored); more = the question environment, each
    turn a reasoning step until an answer containing final_marker (or the last turn). At most agent_proxy.max_turn."""
    final_marker: str = "Final answer:"
    """With max_turns > 1: the text marking an answer as final; the text after it is scored."""
    instruction: str = "Answer the question. Give only the final answer inside <answer></answer>."
    """The task text shown before each prompt (the tag's env_instruction)."""


@dataclass
class CustomRewardFunctionConfig:
    """verl's ``reward.custom_reward_function``: a Python function scoring dataset answers."""

    path: str = ""
    """.py file defining the function ("" = the default math scorer: 1.0 when the answer equals the ground
    truth as a number, fraction or normalised LaTeX, else 0.0)."""
    name: str = "compute_score"
    """The function: compute_score(data_source, solution_str, ground_truth, extra_info) -> float."""


@dataclass
class RewardConfig:
    """Rewards of prompt-dataset episodes (docs/rewards.md)."""

    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)


RM_INPUTS = ("response", "conversation")
"""What the reward model reads: the decoded final reply, or the whole conversation (chat template included)."""


@dataclass
class RewardModelModelConfig:
    """Which sequence-classification checkpoint the reward model loads."""

    path: str = ""
    """Hugging Face folder or hub id of an AutoModelForSequenceClassification with one label (e.g.
    models/tiny-qwen2-rm, built by `make model`). Required when reward_model.enable."""
    dtype: str = "float32"
    """float32 | bfloat16 | float16."""


@dataclass
class RewardModelConfig:
    """verl's ``reward_model`` section: a RewardModelWorker group (FSDP2) scoring each episode."""

    enable: bool = False
    """Start the reward-model workers; each episode's score (times reward_weight) is added on its last
    generated token, next to the environment's rewards (docs/rewards.md)."""
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    input: str = "response"
    """response: the decoded text of the episode's last reply | conversation: the episode's whole token
    sequence decoded (prompt, every turn, chat template), up to its last generated token."""
    reward_weight: float = 1.0
    """Multiplies the score before it is added to the environment rewards."""
    max_length: int = 2048
    """Most tokens the reward model reads per text; a longer text keeps its last max_length tokens."""
    micro_batch_size_per_gpu: int = 4
    """Texts per forward on one rank."""
    world_size: int = 1
    """Reward-model ranks (FSDP2 shards the model across them)."""
    num_cpus_per_rank: float = 0.25
    """Ray CPU accounting per rank."""
    dump_scores: bool = False
    """Append every scored text and its score to <trainer.default_local_dir>/reward_model_scores.jsonl."""
