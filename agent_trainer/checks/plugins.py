"""Registry-name checks: a config that names a plug-in (a context condenser, a trajectory reward computer, a judge
format) is looked up in its registry before ``ray.init``; an unknown name or an import path that is not a subclass is
refused in one line naming the key and the known names (``agent_trainer.common.plugins.PluginRegistry.get``).
"""

from __future__ import annotations

from agent_trainer.condensers.base import CONDENSERS
from agent_trainer.config.multiturn import ContextCondenserConfig
from agent_trainer.config.rewards import RewardComputationConfig
from agent_trainer.config.schema import AgentTrainerConfig
from agent_trainer.trajectory_rewards.base import REWARD_COMPUTERS
from agent_trainer.trajectory_rewards.judge import JUDGE_FORMATS


def check_condenser(config: ContextCondenserConfig) -> None:
    """``multiturn_trajectory.context_condenser.type`` names a registered condenser or one importable by path."""
    CONDENSERS.get(config.type)


def check_reward_computer(config: RewardComputationConfig) -> None:
    """``reward_computation.type`` names a registered reward computer or one importable by path."""
    REWARD_COMPUTERS.get(config.type)


def check_plugins(cfg: AgentTrainerConfig) -> None:
    """Every plug-in name of a trainer config (the agent class is checked with its layout in ``checks.rl``)."""
    check_condenser(cfg.multiturn_trajectory.context_condenser)
    check_reward_computer(cfg.reward_computation)
    JUDGE_FORMATS.get(cfg.judge.mode)  # judge.mode: a registered judge format or one importable by path
