"""SFT warm start on multi-turn conversations, on the RL actor worker (FSDP2).

    python -m agent_trainer.sft --config-name sft_frozenlake [key=value ...]
    python -m agent_trainer.main --config-name frozenlake model_path=<run dir>/final    # then RL

The run, top to bottom (``SFTTrainer.fit``)::

    before ray.init: compose the SFT config and the RL config it names (rl_config), validate
        both; play expert demonstrations through the rollout's EnvStateManager and
        ContextManager (or read JSONL conversations); encode them by the RL mask rules;
        hold out a validation split
    start the actor group (agent_trainer/workers/actor.py ActorWorker, the RL policy worker) and, for
        env success, a rollout engine and env actors (the RL validation rollout)
    evaluate the start: validation loss, and success on the RL config's held-out episodes
    for each optimizer step: a length-bucketed batch -> actor.update_sft (dp_execute)
        evaluate every eval.test_freq steps and after the last; checkpoint (HF folder)

Loss only on assistant tokens, by the RL rules: 1 exactly on each reply's ids and its eos
(``agent_trainer.agents.demonstrations.encode_conversation``). Checkpoints are written by the
worker's ``save_checkpoint`` into ``global_step_N/actor`` (``agent_trainer.common.checkpoint``
layout); ``<run dir>/final`` links the last one, an HF folder the RL trainer loads as
``model_path``. Metrics go to console and JSONL (``sft/``, ``val/``, ``perf/``, ``timing_s/``).
"""

from __future__ import annotations

import logging
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch
from omegaconf import DictConfig, OmegaConf

from agent_trainer.common import checkpoint
from agent_trainer import cli_args
from agent_trainer.common.batch import TensorBatch
from agent_trainer.checks.load import load_sft_config
from agent_trainer.checks.prepare import CONFIG_DIR, CONFIG_ERRORS, compose, prepare
from agent_trainer.checks.sft import check_against_rl
from agent_trainer.config import ActorConfig, AgentTrainerConfig
from agent_trainer.config import config_schema
from agent_trainer.config import errors as config_errors
from agent_trainer.config.loading import sft_schema
from agent_trainer.config.sft import SFTConfig
from agent_trainer.config.splits import Split
from agent_trainer.agents.demonstrations import (DemoEpisode, Demonstration, check_demo_tags, encode_conversation,
                                                 play_demonstrations, read_jsonl, resolve_demonstrator, write_jsonl)
from agent_trainer.episode.es_manager import VAL_SEED_OFFSET
from agent_trainer.ray_cluster import init_ray, shutdown_ray
from agent_trainer.observe.tracking import Tracking, timer
from envs.registry import normalize_tags

if TYPE_CHECKING:
    from agent_trainer.workers.build import Workers

logger = logging.getLogger(__name__)

DEFAULT_CONFIG = "sft_frozenlake"
"""The config ``--config-name`` names when it is not given."""

SFT_SETS = ("model_path", "actor_rollout_ref.model.path", "actor_rollout_ref.rollout.val_kwargs.temperature",
            "trainer.experiment_name", "trainer.seed")
"""RL keys the SFT run sets itself (from model_path, eval.temperature, trainer.experiment_name, trainer.seed);
rl_overrides may not set them."""
BUCKET_BATCHES = 16
"""Length bucketing sorts windows of this many batches by length."""
FINAL_LINK = "final"


# --------------------------------------------------------------------------- data


@dataclass
class SFTRow:
    """One conversation as the policy sees it: token ids and the loss mask (1 on reply tokens)."""

    token_ids: list[int]
    response_mask: list[int]


@dataclass
class SFTData:
    """Training and held-out rows, and the demonstrations they came from (empty for JSONL data)."""

    train: list[SFTRow]
    val: list[SFTRow]
    demos: dict[Split, list[Demonstration]] = field(default_factory=dict)
    """Train / val: the played demonstrations (written to the run folder as ``demonstrations_<split>.jsonl``)."""


@dataclass
class SFTRun:
    """Everything decided before ``ray.init``."""

    cfg: SFTConfig
    rl: AgentTrainerConfig
    """The RL config the warm start is for (composed from rl_config + rl_overrides, validated)."""
    env_tags: dict
    tokenizer: object
    data: SFTData


def compose_rl(cfg: SFTConfig) -> tuple[AgentTrainerConfig, dict]:
    """Compose and validate the RL config (``agent_trainer.checks.prepare``, as for RL); errors name rl_config."""
    for override in cfg.rl_overrides:
        key = override.lstrip("+~").partition("=")[0]
        if key in SFT_SETS:
            raise ValueError(f"rl_overrides sets {key}, which the SFT run sets itself; set model_path, "
                             "eval.temperature, trainer.experiment_name or trainer.seed of the SFT config instead")
    overrides = [*cfg.rl_overrides, f"model_path={cfg.model_path}",
                 f"actor_rollout_ref.rollout.val_kwargs.temperature={cfg.eval.temperature}",
                 f"trainer.experiment_name={cfg.trainer.experiment_name}", f"trainer.seed={cfg.trainer.seed}"]
    try:
        return prepare(compose(cfg.rl_config, overrides))
    except CONFIG_ERRORS as err:
        reason = config_errors.one_line(err, config_schema(), overrides)
        where = f"rl_config = {cfg.rl_config!r} with rl_overrides {list(cfg.rl_overrides)}"
        raise ValueError(f"{where}: {reason}") from None


def prepare_run(raw: DictConfig | dict) -> SFTRun:
    """Validate the SFT and RL configs and build the data; raises ValueError with one line (before Ray)."""
    from transformers import AutoTokenizer

    cfg = load_sft_config(raw)
    rl, env_tags = compose_rl(cfg)
    n_val_groups = rl.es_manager.val.env_groups
    val_start = rl.es_manager.seed + VAL_SEED_OFFSET
    check_against_rl(cfg, rl.actor_rollout_ref.actor.fsdp.world_size, rl.ctx_manager.mode,
                     range(val_start, val_start + n_val_groups), rl.actor_rollout_ref.model.lora_rank)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
    return SFTRun(cfg=cfg, rl=rl, env_tags=env_tags, tokenizer=tokenizer,
                  data=build_data(cfg, rl, env_tags, tokenizer))


def build_data(cfg: SFTConfig, rl: AgentTrainerConfig, env_tags: dict, tokenizer) -> SFTData:
    """Conversations -> rows, split into training and held-out (by episode / conversation, seeded)."""
    from agent_trainer.rollout import make_context_manager

    ctx = make_context_manager(rl, tokenizer)
    if cfg.data.source == "demonstrations":
        demos = make_demonstrations(cfg, rl, env_tags, ctx)
        train, val = split_held_out(demos, cfg.data.val_fraction, cfg.data.seed)
        rows = {name: [SFTRow(d.token_ids, d.response_mask) for d in part] for name, part in
                ((Split.TRAIN, train), (Split.VAL, val))}
        return SFTData(train=rows[Split.TRAIN], val=rows[Split.VAL], demos={Split.TRAIN: train, Split.VAL: val})
    convs = {name: [(path, k, c) for path in files for k, c in enumerate(read_jsonl(path))]
             for name, files in ((Split.TRAIN, cfg.data.train_files), (Split.VAL, cfg.data.val_files))}
    if not convs[Split.VAL]:
        convs[Split.TRAIN], convs[Split.VAL] = split_held_out(convs[Split.TRAIN], cfg.data.val_fraction, cfg.data.seed)
    limit = rl.actor_rollout_ref.rollout.max_model_len
    rows = {}
    for name, items in convs.items():
        rows[name] = []
        for path, k, messages in items:
            ids, mask = encode_conversation(ctx, messages)
            if len(ids) > limit:
                raise ValueError(f"{path}: conversation {k + 1} has {len(ids)} tokens, more than the RL config's "
                                 f"actor_rollout_ref.rollout.max_model_len = {limit}; shorten it or raise that length")
            rows[name].append(SFTRow(ids, mask))
    return SFTData(train=rows[Split.TRAIN], val=rows[Split.VAL])


def make_demonstrations(cfg: SFTConfig, rl: AgentTrainerConfig, env_tags: dict, ctx) -> list[Demonstration]:
    """Play ``data.num_episodes`` expert episodes per tag, as the RL rollout would lay them out."""
    tags = list(cfg.data.tags or rl.es_manager.train.tags)
    demonstrator = resolve_demonstrator(cfg.data.demonstrator)
    check_demo_tags(tags, env_tags, expert=demonstrator is None, noise_actions=list(cfg.data.noise_actions))
    tag_cfgs = normalize_tags(env_tags)
    response_length = rl.actor_rollout_ref.rollout.response_length
    episodes = [DemoEpisode(tag, cfg.data.seed + i) for tag in tags for i in range(cfg.data.num_episodes)]
    return play_demonstrations(
        ctx, env_tags, episodes, max_turn=rl.agent_proxy.max_turn,
        turn_budget={tag: min(tag_cfgs[tag].max_tokens, response_length) for tag in tags},
        noise=cfg.data.noise, noise_seed=cfg.data.seed, format_penalty=rl.es_manager.format_penalty,
        max_actions_per_turn=rl.es_manager.max_actions_per_turn, noise_actions=list(cfg.data.noise_actions),
        demonstrator=demonstrator, think=cfg.data.think)


def split_held_out(items: list, val_fraction: float, seed: int) -> tuple[list, list]:
    """A seeded shuffle, then ``round(val_fraction * n)`` items (at least 1, at most n - 1) held out."""
    if len(items) < 2:
        raise ValueError(f"{len(items)} conversation(s): need at least 2 (one to train on, one held out); add data")
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    n_val = min(len(items) - 1, max(1, round(val_fraction * len(items))))
    return [items[i] for i in sorted(order[n_val:])], [items[i] for i in sorted(order[:n_val])]


def length_batches(rows: list[SFTRow], batch_size: int, rng: random.Random, group_by_length: bool) -> list[list[int]]:
    """One epoch's batches of row indices: shuffled; with bucketing, windows sorted by length first."""
    order = list(range(len(rows)))
    rng.shuffle(order)
    if group_by_length:
        window = batch_size * BUCKET_BATCHES
        order = [i for s in range(0, len(order), window)
                 for i in sorted(order[s:s + window], key=lambda i: len(rows[i].token_ids))]
    batches = [order[s:s + batch_size] for s in range(0, len(order), batch_size)]
    rng.shuffle(batches)
    return batches


def collate(rows: list[SFTRow], pad_id: int) -> TensorBatch:
    """Right-pad rows into input_ids, attention_mask, position_ids, response_mask [B, T] (T = the longest row)."""
    length = max(len(r.token_ids) for r in rows)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
    response_mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, : len(r.token_ids)] = torch.tensor(r.token_ids)
        attention_mask[i, : len(r.token_ids)] = 1
        response_mask[i, : len(r.token_ids)] = torch.tensor(r.response_mask)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return TensorBatch({"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                        "response_mask": response_mask})


def sft_actor_config(cfg: SFTConfig, rl: AgentTrainerConfig) -> ActorConfig:
    """The RL actor's config (FSDP layout, dtype via the model config) with the SFT optimisation."""
    return replace(rl.actor_rollout_ref.actor, ppo_mini_batch_size=cfg.train.batch_size,
                   ppo_micro_batch_size_per_gpu=cfg.train.micro_batch_size_per_gpu, ppo_epochs=1,
                   grad_clip=cfg.train.grad_clip, optim=cfg.train.optim)


# --------------------------------------------------------------------------- trainer


class SFTTrainer:
    """Supervised fine-tuning on the RL actor worker group; evaluation through the RL validation rollout."""

    def __init__(self, run: SFTRun):
        """Prepare the run folder (an earlier run's files are archived) and the metric sinks; no worker starts."""
        self.run, self.cfg, self.rl = run, run.cfg, run.rl
        self.run_dir = Path(self.cfg.trainer.default_local_dir)
        self.global_step = 0
        checkpoint.seed_everything(self.cfg.trainer.seed)
        if (self.run_dir / FINAL_LINK).is_symlink():
            (self.run_dir / FINAL_LINK).unlink()
        checkpoint.prepare_run_dir(self.run_dir, "disable", None, ["actor"])
        for name, demos in run.data.demos.items():
            write_jsonl(demos, self.run_dir / f"demonstrations_{name}.jsonl")
        OmegaConf.save(OmegaConf.structured(self.cfg), self.run_dir / "sft_config.yaml")
        self.tracking = Tracking(self.run_dir, self.cfg.trainer.logger)
        tok = run.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.val_rollout = None
        self.workers: Workers | None = None
        """The started workers (:meth:`init_workers`)."""
        self.engines: list = []

    def init_workers(self, workers: Workers) -> None:
        """Take the started workers (:func:`~agent_trainer.workers.build.build_sft_workers`: the actor group, models
        loaded; engines and the env actor class for env success) and build the validation rollout."""
        from agent_trainer.rollout import make_rollout

        self.workers, self.actor_wg, self.engines = workers, workers.actor, workers.engines
        if self.cfg.eval.env_success:
            self.val_rollout = make_rollout(self.rl, self.run.tokenizer, self.engines, workers.env_worker_cls,
                                            self.run.env_tags, split=Split.VAL,
                                            num_env_actors=self.rl.agent_proxy.num_env_actors,
                                            on_engine_restart=self.sync_weights)

    def total_steps(self) -> int:
        """Optimizer steps of the run: total_epochs full passes, capped by max_steps."""
        per_epoch = math.ceil(len(self.run.data.train) / self.cfg.train.batch_size)
        steps = per_epoch * self.cfg.train.total_epochs
        return min(steps, self.cfg.train.max_steps) if self.cfg.train.max_steps else steps

    def fit(self) -> list[dict[str, float]]:
        """Train for :meth:`total_steps` steps; return every logged step's metrics (step 0 = the start)."""
        history, total = [], self.total_steps()
        if self.cfg.eval.val_before_train:
            history.append(self.evaluate())
            self.tracking.log(history[-1], step=0)
        epoch = 0
        while self.global_step < total:
            rng = random.Random(f"{self.cfg.trainer.seed}/{epoch}")
            for indices in length_batches(self.run.data.train, self.cfg.train.batch_size, rng,
                                          self.cfg.train.group_by_length):
                if self.global_step >= total:
                    break
                self.global_step += 1
                metrics = self.train_step([self.run.data.train[i] for i in indices])
                metrics["sft/epoch"] = float(epoch + 1)
                self.after_step(metrics, is_last=self.global_step == total)
                history.append(metrics)
            epoch += 1
        self.tracking.close()
        return history

    def train_step(self, rows: list[SFTRow]) -> dict[str, float]:
        """One optimizer step on ``rows`` (padded with zero-mask rows to a whole batch)."""
        from agent_trainer.training.trainer import pad_for_update

        metrics: dict[str, float] = {}
        with timer("step", metrics):
            batch, n_pad = pad_for_update(collate(rows, self.pad_id), self.cfg.train.batch_size)
            batch.meta.progress = (self.global_step - 1) / self.total_steps()
            with timer("update_actor", metrics):
                per_rank = self.actor_wg.dp_execute("update_sft", batch)
        metrics.update(token_metrics(per_rank, "sft/"))
        metrics["sft/grad_norm"] = per_rank[0]["sft/grad_norm"]
        metrics["sft/lr"] = per_rank[0]["sft/lr"]
        attention = batch["attention_mask"][: len(rows)]
        metrics["perf/padding_ratio"] = 1.0 - float(attention.sum()) / attention.numel()
        metrics["perf/max_seq_len"] = float(attention.shape[1])
        metrics["perf/update_sft_padding_rows"] = float(n_pad)
        return metrics

    def after_step(self, metrics: dict[str, float], is_last: bool) -> None:
        """Evaluate and checkpoint when due; log the step."""
        freq = self.cfg.eval.test_freq
        if is_last or (freq > 0 and self.global_step % freq == 0):
            with timer("validate", metrics):
                metrics.update(self.evaluate())
        save_freq = self.cfg.trainer.save_freq
        if is_last or (save_freq > 0 and self.global_step % save_freq == 0):
            with timer("save", metrics):
                self.save_checkpoint(metrics, merge=is_last and self.cfg.trainer.merge_lora)
        self.tracking.log(metrics, step=self.global_step)

    def evaluate(self) -> dict[str, float]:
        """``val/sft_loss`` and ``val/sft_token_acc`` on the held-out rows; env success with ``eval.env_success``."""
        from agent_trainer.training.trainer import pad_for_update

        world = self.rl.actor_rollout_ref.actor.fsdp.world_size
        rows = sorted(self.run.data.val, key=lambda r: len(r.token_ids))
        per_rank: list[dict[str, float]] = []
        for start in range(0, len(rows), self.cfg.train.batch_size):
            batch, _ = pad_for_update(collate(rows[start:start + self.cfg.train.batch_size], self.pad_id), world)
            per_rank += self.actor_wg.dp_execute("compute_sft_loss", batch)
        metrics = token_metrics(per_rank, "val/sft_")
        if self.val_rollout is not None:
            self.sync_weights()
            metrics.update(self.val_rollout.rollout(self.global_step).metrics)
        return metrics

    def sync_weights(self) -> float:
        """Ship the actor's weights to every engine (the workers' own sync, as RL does)."""
        return self.workers.sync_weights()

    def save_checkpoint(self, metrics: dict[str, float], merge: bool = False) -> Path:
        """``global_step_N/actor``: the worker's HF folder plus the tokenizer; ``<run dir>/final`` links it. With
        ``merge`` (a LoRA run's last step, ``trainer.merge_lora``) also ``global_step_N/merged``, the base model with
        the adapter merged in, which ``final`` links instead."""
        import ray

        from agent_trainer.training.model_export import export_merged

        def write(tmp: Path) -> None:
            ray.get(self.actor_wg.execute_all_async("save_checkpoint", str(tmp / "actor")))
            self.run.tokenizer.save_pretrained(str(tmp / "actor"))
            OmegaConf.save(OmegaConf.structured(self.cfg), tmp / "sft_config.yaml")

        final = checkpoint.save_step(self.run_dir, self.global_step, write, lambda: checkpoint.TrainerState(
            global_step=self.global_step, rng=checkpoint.rng_state(), parts=["actor"], metrics=dict(metrics),
            saved_at=time.time()))
        part = "actor"
        if merge:  # after the adapter's checkpoint is saved: a failed merge loses nothing
            export_merged(final / "actor", final / "merged", base=Path(self.cfg.model_path))
            part = "merged"
        link = self.run_dir / FINAL_LINK
        if link.is_symlink():
            link.unlink()
        link.symlink_to(Path(final.name) / part, target_is_directory=True)
        return final / part


def token_metrics(per_rank: list[dict[str, float]], prefix: str) -> dict[str, float]:
    """``<prefix>loss`` (token-mean NLL), ``<prefix>token_acc`` (greedy), ``<prefix>tokens`` from the ranks' sums."""
    tokens = sum(m["sft/tokens"] for m in per_rank)
    return {f"{prefix}loss": sum(m["sft/nll_sum"] for m in per_rank) / max(tokens, 1.0),
            f"{prefix}token_acc": sum(m["sft/correct"] for m in per_rank) / max(tokens, 1.0),
            f"{prefix}tokens": tokens}


# --------------------------------------------------------------------------- entry point


def compose_sft(config_name: str, overrides: Sequence[str] = ()) -> SFTRun:
    """Compose ``config/<config_name>.yaml`` with overrides and prepare the run (a mistake: SystemExit, one line)."""
    try:
        return prepare_run(compose(config_name, overrides))
    except CONFIG_ERRORS as err:
        raise SystemExit(f"agent-trainer sft: {config_errors.one_line(err, sft_schema(), overrides)}") from None


def train(run: SFTRun) -> list[dict[str, float]]:
    """Start Ray and the workers, run SFT, print the before/after summary; return the logged metrics."""
    from agent_trainer.workers.build import build_sft_workers  # the worker classes: torch, ray

    init_ray(run.rl)
    trainer = SFTTrainer(run)
    trainer.init_workers(build_sft_workers(run.rl, sft_actor_config(run.cfg, run.rl), run.cfg.trainer.seed,
                                           engines=run.cfg.eval.env_success))
    history = trainer.fit()
    model = None if run.cfg.trainer.merge_lora else run.rl.actor_rollout_ref.model
    print(summary(history, trainer.run_dir, model), flush=True)
    return history


def summary(history: list[dict[str, float]], run_dir: Path, model=None) -> str:
    """One paragraph: validation loss and env success at the start and the end, and the model folder; with a LoRA
    ``model`` (the RL config's ``actor_rollout_ref.model``) the RL command starts from the base plus the adapter."""
    first, last = history[0], history[-1]
    parts = [f"SFT done after {last.get('sft/epoch', 0):.0f} epoch(s)"]
    for key in ("val/sft_loss", "val/sft_token_acc", "val/success_rate"):
        if key in last:
            start = f"{first[key]:.4g} -> " if key in first and first is not last else ""
            parts.append(f"{key} {start}{last[key]:.4g}")
    final = run_dir / FINAL_LINK
    if model is not None and model.lora_rank:
        m = "actor_rollout_ref.model"
        targets = "[" + ",".join(model.target_modules) + "]"
        parts.append(f"adapter: {final} (RL: python -m agent_trainer.main model_path={model.path} "
                     f"{m}.lora_rank={model.lora_rank} {m}.lora_alpha={model.lora_alpha} '{m}.target_modules={targets}' "
                     f"{m}.lora_adapter_path={final})")
    else:
        parts.append(f"model: {final} (RL: python -m agent_trainer.main model_path={final})")
    return "; ".join(parts)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m agent_trainer.sft --config-name NAME [key=value ...]`` (``agent_trainer.cli_args``, as the other
    entry points; ``--help`` prints the usage and the composed config): hydra's compose, then :func:`train`."""
    args = cli_args.command_line(sys.argv[1:] if argv is None else argv, "python -m agent_trainer.sft",
                                 __doc__.splitlines()[0], DEFAULT_CONFIG, CONFIG_DIR)
    if args is None:
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        train(compose_sft(args.config_name, args.overrides))
    finally:
        shutdown_ray()  # here, not in Ray's exit hook, where any thread alive at exit could end the process


if __name__ == "__main__":
    main()
