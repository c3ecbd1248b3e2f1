"""The multi-turn rollout: episodes fanned out to Ray env actors and rollout engines.

One call to :meth:`MultiTurnRollout.rollout` (``SyncMultiTurnRollout``, the name the design notes use) plays ``env_groups x
group_size`` episodes for up to ``agent_proxy.max_turn`` turns and returns
one training batch plus metrics::

    reset env actors (one seed per group; es_manager.prefetch_reset: started as the last rollout ended)
    for turn in 1..max_turn, while any episode is active:
        prompts  <- ctx_manager: token ids of each active episode's next turn
        outputs  <- rollout engines: generate(token ids) -> token ids + logprobs
        env actors: parse <answer>, step env, reward, done
    start the next rollout's reset (prefetch_reset), which runs while the step trains
    batch    <- ctx_manager.build_update_batch()

``actor_rollout_ref.rollout.mode=async`` plays the same turns without the barrier between
them: each group's next turn goes to the engines as soon as its own env step returns
(:class:`~agent_trainer.rollout.lanes.BarrierFreeLoop`, docs/architecture.md).

``ctx_manager.mode`` picks the layout: ``full`` (one growing sequence and one
row per episode, ``agent_trainer.agents.ctx_manager``) or ``condensed`` (a fresh
prompt per turn and one row per turn, ``agent_trainer.agents.condensed_ctx``).
``agent_proxy.agent_cls`` (or ``AgentTrainer(agent_cls=...)``) puts another agent in the
context manager's place (docs/agents.md); every batch an agent builds is checked against the
token-in/token-out contract before it leaves the rollout (``agent_trainer.agents.contract``).

Faults end only what they touch (docs/reliability.md):

- an env actor that dies is reported (``rollout/env_actor_failures``) and its episodes end
  where they are; Ray restarts it (``max_restarts``), so the next reset finds it again;
- an env actor that misses ``es_manager.env_step_timeout_s`` / ``env_reset_timeout_s`` is
  killed and replaced (``agent_trainer.rollout.env_pool``); its episodes end with an error
  (``env/<tag>/timeouts``, ``rollout/env_timeouts``);
- an episode whose reset raises or times out is dropped from the step
  (``rollout/reset_failures``); more than ``es_manager.max_failed_reset_fraction`` of the
  split stops the run with an error naming the tag, the seed and the exception;
- an episode that ends in an environment error (its step raised or returned the wrong shape or types) keeps
  its turns; more than ``es_manager.max_env_error_fraction`` of the split's started episodes stops the run
  the same way (``EnvFailure``, one line);
- an exception from an environment is logged once per (tag, exception type) with its text;
- an episode whose next prompt would not fit ``max_model_len`` ends as truncated
  (``rollout/context_overflow_rate``) and keeps the rewards it earned;
- an engine that dies or misses ``actor_rollout_ref.rollout.generate_timeout_s`` is
  restarted, re-synced and the turn generated once more (``rollout/engine_failures``).

The modules, by responsibility:

- ``multiturn``: :class:`MultiTurnRollout`, what lives across rollouts (agent, env actors, seed counter), and
  one rollout's order of work;
- ``splits``: which groups a split plays, its sampling, the engines' seeds (``sampling_seed``, ``episode_seed``);
- ``resets``: the group seeds, the reset of every env actor with its faults, the prefetched next reset;
- ``turns``: the turn-synchronous loop and the steps both loops share;
- ``lanes``: the loop without a turn barrier (one lane per group);
- ``engines``: one turn fanned out over the engines, a dead or stuck engine restarted and the turn retried;
- ``results``: the batch, its contract check, the metrics and the faults of one rollout.
"""

from agent_trainer.rollout.engines import get_or_kill
from agent_trainer.rollout.gateway import GatewayRollout
from agent_trainer.rollout.lanes import BarrierFreeLoop, Lane
from agent_trainer.rollout.multiturn import MultiTurnRollout, make_context_manager
from agent_trainer.rollout.resets import EnvResets
from agent_trainer.rollout.results import (EnvFailure, RolloutFaults, RolloutResult, check_env_errors,
                                           episode_rewards, rollout_metrics, screen_nonfinite)
from agent_trainer.rollout.splits import SPLITS, SamplingParams, episode_seed, sampling_params, sampling_seed
from agent_trainer.rollout.turns import TurnLoop

SyncMultiTurnRollout = MultiTurnRollout
"""The rollout's name in the design notes and for users: it plays the turn-synchronous loop, and the loop
without a barrier when ``rollout.mode=async``."""


def make_rollout(cfg, tokenizer, engines: list, env_worker_cls, env_tags: dict, **kwargs) -> MultiTurnRollout:
    """A split's rollout: the user's agent function through the gateway when ``agent_proxy.gateway.agent`` is set
    (:class:`~agent_trainer.rollout.gateway.GatewayRollout`, docs/gateway.md), else the built-in turn loop."""
    cls = GatewayRollout if cfg.agent_proxy.gateway.agent else MultiTurnRollout
    return cls(cfg, tokenizer, engines, env_worker_cls, env_tags, **kwargs)


__all__ = ["BarrierFreeLoop", "EnvFailure", "EnvResets", "GatewayRollout", "Lane", "MultiTurnRollout", "RolloutFaults", "RolloutResult",
           "SPLITS", "SamplingParams", "SyncMultiTurnRollout", "TurnLoop", "check_env_errors", "episode_rewards",
           "episode_seed", "get_or_kill", "make_context_manager", "make_rollout", "rollout_metrics", "sampling_params",
           "sampling_seed", "screen_nonfinite"]
