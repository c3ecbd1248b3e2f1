"""Start-up checks of the SFT config (``agent_trainer.config.sft``): alone, and against the RL config it warms up.

Each refusal is one line naming the key, the value and the fix, before ``ray.init``.
"""

from __future__ import annotations

from agent_trainer.checks.rules import Rule, above, at_least, between, check_optim, get_key, is_number, optional
from agent_trainer.config.choices import DATA_SOURCES, LOGGERS, THINK_MODES
from agent_trainer.config.errors import check_choice
from agent_trainer.config.sft import SFTConfig


RANGES: list[tuple[str, Rule, str]] = [
    ("data.num_episodes", at_least(2, " (at least one training and one held-out episode)"), "256"),
    ("data.noise", between(0, 1, False, False), "0.1"),
    ("data.seed", at_least(0), "0"),
    ("data.val_fraction", between(0, 1, True, True), "0.1"),
    ("train.total_epochs", at_least(1), "2"),
    ("train.max_steps", optional(at_least(1)), "null"),
    ("train.batch_size", at_least(1), "16"),
    ("train.micro_batch_size_per_gpu", at_least(1), "4"),
    ("train.grad_clip", above(0), "1.0"),
    ("train.optim.lr", above(0), "1e-4"),
    ("train.optim.weight_decay", at_least(0), "0.0"),
    ("train.optim.warmup_steps", at_least(0), "0"),
    ("train.optim.min_lr_ratio", between(0, 1, False, False), "0.1"),
    ("eval.temperature", at_least(0, " (0 = greedy)"), "0.0"),
    ("trainer.seed", at_least(0), "0"),
]
"""Single-key numeric ranges (a non-finite number never passes)."""


def validate_sft_config(cfg: SFTConfig) -> None:
    """The rules that need only this config; raises ValueError with one line naming the key, the value and the fix."""
    for key, rule, example in RANGES:
        value = get_key(cfg, key)
        ok = rule.allow_none if value is None else is_number(value) and rule.test(value)
        if not ok:
            raise ValueError(f"{key} = {value!r} {rule.text}; e.g. {key}={example}")
    check_choice("data.source", cfg.data.source, DATA_SOURCES)
    check_choice("data.think", cfg.data.think, THINK_MODES)
    for name in cfg.trainer.logger:
        check_choice("trainer.logger", name, LOGGERS)
    check_optim("train.optim", cfg.train.optim)
    data = cfg.data
    if data.source == "jsonl" and not data.train_files:
        raise ValueError("data.train_files = [] but data.source = 'jsonl' reads its conversations from there; give "
                         "data.train_files=[path/to/train.jsonl] or use data.source=demonstrations")
    if data.source == "demonstrations" and (data.train_files or data.val_files):
        raise ValueError(f"data.train_files = {data.train_files} / data.val_files = {data.val_files} are read only "
                         "with data.source=jsonl; set data.source=jsonl or drop the files")
    if data.source == "jsonl":
        set_keys = [f"data.{key} = {value!r}" for key, value, default in (
            ("tags", list(data.tags), []), ("noise", data.noise, 0.0), ("noise_actions", list(data.noise_actions), []),
            ("demonstrator", data.demonstrator, "expert"), ("think", data.think, "plain")) if value != default]
        if set_keys:
            raise ValueError(f"{' / '.join(set_keys)} apply to data.source=demonstrations only; drop them with "
                             "data.source=jsonl (a config that sets them: override with the default, e.g. "
                             "data.demonstrator=expert)")
    if data.noise_actions and not data.noise:
        raise ValueError(f"data.noise_actions = {list(data.noise_actions)} is what noisy turns draw from, but "
                         "data.noise = 0 makes none; set data.noise (1.0 = a format-only warm start) or drop it")


def check_against_rl(cfg: SFTConfig, world_size: int, ctx_mode: str, val_seeds: range, lora_rank: int) -> None:
    """Rules that relate this config to the composed RL config."""
    if cfg.trainer.merge_lora and not lora_rank:
        raise ValueError("trainer.merge_lora = True merges a LoRA adapter, but the RL config's "
                         "actor_rollout_ref.model.lora_rank = 0 trains the full model; add "
                         "'rl_overrides=[\"actor_rollout_ref.model.lora_rank=16\"]' or drop trainer.merge_lora")
    if cfg.train.batch_size % world_size:
        raise ValueError(f"train.batch_size = {cfg.train.batch_size} must be a multiple of the RL config's "
                         f"actor_rollout_ref.actor.fsdp.world_size = {world_size} (every rank takes an equal share); "
                         f"e.g. train.batch_size={max(world_size, cfg.train.batch_size // world_size * world_size)}")
    if ctx_mode != "full":
        raise ValueError(f"ctx_manager.mode = {ctx_mode!r} in rl_config {cfg.rl_config!r}: SFT lays conversations out "
                         "as one sequence per episode (mode full); warm up with an RL config in mode full "
                         "(e.g. rl_overrides=[ctx_manager.mode=full])")
    demo_seeds = range(cfg.data.seed, cfg.data.seed + cfg.data.num_episodes)
    if cfg.data.source == "demonstrations" and demo_seeds.start < val_seeds.stop and val_seeds.start < demo_seeds.stop:
        raise ValueError(f"data.seed = {cfg.data.seed} with data.num_episodes = {cfg.data.num_episodes} reaches the RL "
                         f"validation seeds [{val_seeds.start}, {val_seeds.stop}); held-out episodes must stay unseen: "
                         "e.g. data.seed=0")
