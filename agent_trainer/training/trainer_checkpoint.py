"""The RL trainer's checkpoint of a step: what ``AgentTrainer`` saves into ``global_step_N/`` and restores from it.

``agent_trainer.common.checkpoint`` holds the folder's format (``trainer_state.json``, the atomic save, the
``latest_checkpointed_iteration.txt`` pointer, pruning, the resume decision); this module fills one folder from a
running trainer and reads one back into it:

* the actor's and (with a value estimator) the critic's FSDP shards, every rank of each group writing its own
  concurrently (with ``trainer.save_hf_model``, rank 0 also the Hugging Face weights);
* the tokenizer beside the actor, and the resolved config (``config.yaml``, read back by ``agent_trainer.eval``);
* the driver's state (``checkpoint.TrainerState``): the step, each split's env reset counter, the adaptive KL
  coefficient, the RNG states, and the step's metrics (a resume re-logs them if the run died before logging).

``trainer``: an ``agent_trainer.training.trainer.AgentTrainer`` (its worker groups, rollouts, prefetch buffer, KL
controller, policy versions and tracking).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import ray

from agent_trainer.common import checkpoint
from agent_trainer.config.splits import Split

logger = logging.getLogger(__name__)


def save(trainer: Any, metrics: dict[str, float] | None = None) -> Path:
    """Save everything a resume needs into ``global_step_N/``, atomically; return that folder.

    Actor and critic ranks write their shards concurrently into a temporary folder (and,
    with ``trainer.save_hf_model``, rank 0 of each the HF weights); the driver adds the
    tokenizer, the resolved config and ``trainer_state.json``, then renames the folder into
    place and updates ``latest_checkpointed_iteration.txt`` (``agent_trainer.common.checkpoint``).
    ``metrics`` (this step's) are kept so a resume can re-log them if the run died before logging.
    """
    from omegaconf import OmegaConf

    groups = {"actor": trainer.actor_wg, "critic": trainer.critic_wg}
    hf_model = trainer.cfg.trainer.save_hf_model

    def write(tmp: Path) -> None:
        ray.get([ref for part in trainer.checkpoint_parts
                 for ref in groups[part].execute_all_async("save_checkpoint", str(tmp / part), role=part,
                                                           hf_model=hf_model)])
        trainer.tokenizer.save_pretrained(str(tmp / "actor"))
        OmegaConf.save(OmegaConf.structured(trainer.cfg), tmp / "config.yaml")

    final = checkpoint.save_step(trainer.run_dir, trainer.global_step, write, lambda: checkpoint.TrainerState(
        global_step=trainer.global_step,
        env_resets=env_resets(trainer),
        kl_coef=trainer.kl_ctrl.value if trainer.kl_ctrl is not None else None,
        rng=checkpoint.rng_state(), parts=list(trainer.checkpoint_parts), metrics=dict(metrics or {}),
        saved_at=time.time(),
    ))
    untrained = trainer.stream.untrained() if trainer.stream is not None else 0
    if untrained:
        logger.info("%s holds none of the %d groups in flight or not yet trained; a run resumed from it starts "
                    "from new group seeds (trainer.refill=group)", final, untrained)
    if len(trainer.prefetch):  # trainer.max_off_policy_steps: a resumed run generates them again
        logger.info("%s holds none of the %d buffered rollouts (steps %s); a run resumed from it generates "
                    "them again", final, len(trainer.prefetch), [p.step for p in trainer.prefetch.pending])
    trainer_cfg = trainer.cfg.trainer
    checkpoint.prune(trainer.run_dir, "actor", trainer_cfg.max_actor_ckpt_to_keep)
    checkpoint.prune(trainer.run_dir, "critic", trainer_cfg.max_critic_ckpt_to_keep)
    return final


def env_resets(trainer: Any) -> dict[Split, int]:
    """Each split's reset counter as of the steps trained so far: a prefetched rollout's draw is not counted,
    so a run resumed from here plays that step from the same initial states."""
    resets = {split: rollout.num_resets for split, rollout in trainer.rollouts.items()}
    if trainer.stream is not None:  # trainer.refill=group: past every group started (the untrained discarded)
        resets[Split.TRAIN] = trainer.stream.resume_resets()
        return resets
    buffered = trainer.prefetch.first_resets()
    if buffered is not None:
        resets[Split.TRAIN] = buffered
    return resets


def load(trainer: Any, path: Path) -> None:
    """Restore workers and driver state from a ``global_step_N`` folder; the next step is N + 1."""
    groups = {"actor": trainer.actor_wg, "critic": trainer.critic_wg}
    ray.get([ref for part in trainer.checkpoint_parts
             for ref in groups[part].execute_all_async("load_checkpoint", str(Path(path) / part), role=part)])
    state = checkpoint.TrainerState.load(Path(path))
    trainer.global_step = state.global_step
    trainer.versions.reset(state.global_step)
    for split, rollout in trainer.rollouts.items():
        rollout.num_resets = state.env_resets.get(split, 0)
    if trainer.kl_ctrl is not None and state.kl_coef is not None:
        trainer.kl_ctrl.value = state.kl_coef
    checkpoint.set_rng_state(state.rng)
    if state.metrics:
        trainer.tracking.ensure_logged(state.metrics, step=state.global_step)
    logger.info("resumed from %s: step %d done, continuing at step %d of %d", path, state.global_step,
                state.global_step + 1, trainer.cfg.trainer.total_training_steps)
