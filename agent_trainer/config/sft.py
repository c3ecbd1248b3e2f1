"""Typed configuration of the SFT warm start (``python -m agent_trainer.sft --config-name sft_frozenlake``).

An SFT run names the RL config it warms up for (``rl_config`` + ``rl_overrides``, composed
and validated like ``agent_trainer.main`` does): the prompt format (``agent_proxy.enable_think``,
``es_manager.action_sep``, ``max_model_len``), the per-turn token budget, ``max_turn``, the
env tags, the FSDP layout and dtype of the actor, the rollout engine and the held-out
validation episodes all come from it, so the SFT data and its greedy evaluation are exactly
what that RL run will see. ``model_path`` is the model SFT starts from.

Every mistake is refused before ``ray.init`` with one line naming the key, the value and
the fix (:func:`agent_trainer.checks.sft.validate_sft_config`, :func:`agent_trainer.sft.prepare`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agent_trainer.config.workers import OptimConfig

DATA_SOURCES = ("demonstrations", "jsonl")


@dataclass
class SFTDataConfig:
    """Where the conversations come from, and the held-out split for the validation loss."""

    source: str = "demonstrations"
    """demonstrations (expert episodes played now, agent_trainer/agents/demonstrations.py) | jsonl (train_files)."""
    train_files: list[str] = field(default_factory=list)
    """jsonl: JSONL files, one {"messages": [...]} conversation per line (docs/sft.md)."""
    val_files: list[str] = field(default_factory=list)
    """jsonl: held-out conversations for the validation loss; empty = val_fraction of train_files."""
    tags: list[str] = field(default_factory=list)
    """demonstrations: env tags with an expert solver; empty = the RL config's training tags."""
    num_episodes: int = 256
    """demonstrations: episodes per tag (training and held-out together), reset with seeds seed, seed+1, ..."""
    noise: float = 0.0
    """demonstrations: the fraction of turns whose action is a random valid action instead of the expert's
    (seeded), for a deliberately imperfect warm start."""
    noise_actions: list[str] = field(default_factory=list)
    """demonstrations: the actions a noisy turn draws from (each must be one of the tag's valid actions);
    [] = all of them. Where a tag describes its actions in prose ("a whole number from 1 to 10") there is no list
    to draw from: noise needs this list (e.g. [1, 2, 3]), taken as given. With noise 1.0 this is a format-only
    warm start: replies in format, moves drawn from these actions, nothing learned about the maps (e.g. [Down,
    Right] on FrozenLake)."""
    demonstrator: str = "expert"
    """demonstrations: who picks the non-noisy moves: expert (the environment's ``expert_action``) or the
    import path "package.module:function" of a scripted policy ``function(env, rng) -> action`` (e.g.
    ``envs.frozen_lake:step_into_holes``, a policy that reads the map with the opposite aim)."""
    think: str = "plain"
    """demonstrations: what each reply thinks before its answer: plain ("The best move now is <action>.") or note
    (the env's ``note()`` when it has one, else the observation the reply answers, copied: the model learns to
    write what it reads, then to answer from its own note a few tokens back; noisy turns note too). A scripted
    policy that returns (action, think) keeps its own."""
    seed: int = 0
    """First demonstration seed; also seeds the noise and the train/held-out split. Demonstration seeds must stay
    out of the RL config's validation seeds (es_manager.seed + 2**30 + group)."""
    val_fraction: float = 0.1
    """Share of the conversations held out for the validation loss (when val_files is empty)."""


@dataclass
class SFTTrainConfig:
    """The optimisation."""

    total_epochs: int = 2
    """Passes over the training conversations."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (None = total_epochs full passes)."""
    batch_size: int = 16
    """Conversations per optimizer step, across all actor ranks (a multiple of the RL config's
    actor_rollout_ref.actor.fsdp.world_size)."""
    micro_batch_size_per_gpu: int = 4
    """Conversations per forward/backward on one rank (gradient accumulation inside a step)."""
    group_by_length: bool = True
    """Length bucketing: each epoch, shuffle, then sort windows of 16 batches by length, so a batch holds
    conversations of similar length (less padding); batch order is shuffled again."""
    grad_clip: float = 1.0
    """Max global gradient norm."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3))
    """AdamW (the actor worker's optimizer)."""


@dataclass
class SFTEvalConfig:
    """Validation loss on the held-out conversations and success on the RL config's validation episodes."""

    test_freq: int = 20
    """Evaluate every N steps and after the last; <= 0: only after the last."""
    val_before_train: bool = True
    """Evaluate the starting model first (step 0)."""
    env_success: bool = True
    """Play the RL config's validation split (es_manager.val, its fixed held-out seeds) with the model through
    the RL rollout (engine + env actors) and report val/success_rate."""
    temperature: float = 0.0
    """Sampling temperature of those episodes (0 = greedy); replaces the RL config's val_kwargs.temperature."""


@dataclass
class SFTTrainerConfig:
    """Run folder, logging, checkpoints."""

    project_name: str = "agent_trainer"
    """Groups runs in the output folder."""
    experiment_name: str = "sft"
    """This run's name."""
    default_local_dir: str = "outputs/${trainer.project_name}/${trainer.experiment_name}"
    """Run directory: metrics.jsonl, demonstrations, checkpoints (global_step_N/actor is an HF folder; the
    last one is also linked as <run dir>/final, the model_path of an RL run)."""
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    """console | jsonl | tensorboard."""
    save_freq: int = -1
    """Save a checkpoint every N steps; the last step is always saved. <= 0: only the last."""
    merge_lora: bool = False
    """A LoRA warm start (rl_overrides' actor_rollout_ref.model.lora_rank): the last checkpoint also holds
    global_step_N/merged, the base model with the adapter merged in (peft's merge_and_unload), and <run dir>/final
    links to it, so RL starts from the warm start as from a full model (model_path=<run dir>/final)."""
    seed: int = 0
    """Seeds the actor ranks and the order of the training batches, and is the RL config's trainer.seed (which
    seeds its validation seeds and the engine): one seed for the whole warm start."""


@dataclass
class SFTConfig:
    """The whole SFT run."""

    model_path: str = "models/tiny-qwen2"
    """The model SFT starts from (Hugging Face folder or hub id)."""
    rl_config: str = "frozenlake"
    """The RL config (config/<name>.yaml) this warm start is for: prompt format, turn budget, max_turn, tags,
    actor FSDP layout, rollout engine and validation episodes come from it."""
    rl_overrides: list[str] = field(default_factory=list)
    """key=value overrides applied to rl_config (as on the RL command line); on the SFT command line quote each:
    'rl_overrides=["agent_proxy.max_turn=4"]'. model_path, val_kwargs.temperature, trainer.experiment_name and
    trainer.seed are set by the SFT run (trainer.seed is the SFT's own)."""
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    train: SFTTrainConfig = field(default_factory=SFTTrainConfig)
    eval: SFTEvalConfig = field(default_factory=SFTEvalConfig)
    trainer: SFTTrainerConfig = field(default_factory=SFTTrainerConfig)
