"""Typed configuration of the SFT warm start (``python -m agent_trainer.sft --config-name sft_frozenlake``).

An SFT run names the RL config it warms up for (``rl_config`` + ``rl_overrides``, composed
and validated like ``agent_trainer.main`` does): the prompt format (``agent_proxy.enable_think``,
``es_manager.action_sep``, ``max_model_len``), the per-turn token budget, ``max_turn``, the
env tags, the FSDP layout and dtype of the actor, the rollout engine and the held-out
validation episodes all come from it, so the SFT data and its greedy evaluation are exactly
what that RL run will see. ``model_path`` is the model SFT starts from.

Every mistake is refused before ``ray.init`` with one line naming the key, the value and
the fix (:func:`validate_sft_config`, :func:`agent_trainer.sft.prepare`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf

from agent_trainer import core_algos
from agent_trainer.config import OptimConfig, merge_onto_schema
from agent_trainer.config_checks import LOGGERS, Rule, _get, _is_number, above, at_least, between, optional

DATA_SOURCES = ("demonstrations", "jsonl")


@dataclass
class SFTDataConfig:
    """Where the conversations come from, and the held-out split for the validation loss."""

    source: str = "demonstrations"
    """demonstrations (expert episodes played now, agent_trainer/demonstrations.py) | jsonl (train_files)."""
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
    seed: int = 0
    """Seeds the actor ranks and the order of the training batches (the RL config's trainer.seed seeds its
    validation seeds and the engine)."""


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
    'rl_overrides=["agent_proxy.max_turn=4"]'. model_path and val_kwargs.temperature are set by the SFT run."""
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    train: SFTTrainConfig = field(default_factory=SFTTrainConfig)
    eval: SFTEvalConfig = field(default_factory=SFTEvalConfig)
    trainer: SFTTrainerConfig = field(default_factory=SFTTrainerConfig)


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
    ("eval.temperature", at_least(0, " (0 = greedy)"), "0.0"),
    ("trainer.seed", at_least(0), "0"),
]
"""Single-key numeric ranges (a non-finite number never passes)."""


def validate_sft_config(cfg: SFTConfig) -> None:
    """The rules that need only this config; raises ValueError with one line naming the key, the value and the fix."""
    for key, rule, example in RANGES:
        value = _get(cfg, key)
        ok = rule.allow_none if value is None else _is_number(value) and rule.test(value)
        if not ok:
            raise ValueError(f"{key} = {value!r} {rule.text}; e.g. {key}={example}")
    core_algos.check_choice("data.source", cfg.data.source, DATA_SOURCES)
    for name in cfg.trainer.logger:
        core_algos.check_choice("trainer.logger", name, LOGGERS)
    betas = list(cfg.train.optim.betas)
    if not (len(betas) == 2 and all(_is_number(b) and 0 <= b < 1 for b in betas)):
        raise ValueError(f"train.optim.betas = {betas} must be two numbers in [0, 1); "
                         "e.g. train.optim.betas=[0.9,0.999]")
    data = cfg.data
    if data.source == "jsonl" and not data.train_files:
        raise ValueError("data.train_files = [] but data.source = 'jsonl' reads its conversations from there; give "
                         "data.train_files=[path/to/train.jsonl] or use data.source=demonstrations")
    if data.source == "demonstrations" and (data.train_files or data.val_files):
        raise ValueError(f"data.train_files = {data.train_files} / data.val_files = {data.val_files} are read only "
                         "with data.source=jsonl; set data.source=jsonl or drop the files")
    if data.source == "jsonl" and (data.tags or data.noise):
        raise ValueError(f"data.tags = {data.tags} / data.noise = {data.noise} apply to data.source=demonstrations "
                         "only; drop them with data.source=jsonl")


def check_against_rl(cfg: SFTConfig, world_size: int, ctx_mode: str, val_seeds: range) -> None:
    """Rules that relate this config to the composed RL config."""
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


@lru_cache(maxsize=1)
def sft_schema() -> DictConfig:
    """The typed schema as an OmegaConf node (callers must not modify it)."""
    return OmegaConf.structured(SFTConfig)


def load_sft_config(cfg: DictConfig | Mapping[str, Any]) -> SFTConfig:
    """Check the keys against the schema, merge, resolve, validate (like ``agent_trainer.config.load_config``)."""
    typed: SFTConfig = merge_onto_schema(cfg, sft_schema())
    validate_sft_config(typed)
    return typed


def config_table() -> str:
    """The SFT keys as a Markdown table (key, default, meaning) from the field docstrings, for docs/sft.md."""
    import dataclasses
    import sys

    from launch.config_docs import field_docs

    docs = field_docs(sys.modules[__name__], sys.modules[OptimConfig.__module__])
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]

    def walk(prefix: str, obj: object) -> None:
        for f in dataclasses.fields(obj):
            value, key = getattr(obj, f.name), f"{prefix}{f.name}"
            if dataclasses.is_dataclass(value):
                walk(f"{key}.", value)
                continue
            doc = docs.get((type(obj).__name__, f.name), "").replace("|", "\\|")
            rows.append(f"| `{key}` | `{value!r}` | {doc} |")

    walk("", SFTConfig())
    return "\n".join(rows)


DOCS_PAGE = "docs/sft.md"
TABLE_START, TABLE_END = "<!-- sft-config:start -->", "<!-- sft-config:end -->"


def render_docs(page: str) -> str:
    """``page`` with the text between the table markers replaced by :func:`config_table`."""
    head, _, rest = page.partition(TABLE_START)
    _, _, tail = rest.partition(TABLE_END)
    return f"{head}{TABLE_START}\n{config_table()}\n{TABLE_END}{tail}"


def main() -> None:
    """``python -m agent_trainer.sft_config``: rewrite the config table of docs/sft.md."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / DOCS_PAGE
    path.write_text(render_docs(path.read_text()))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
