"""Trajectory reward computers for multi-turn GRPO (seed 004), and the coding sandbox.

Register a computer with ``@register_reward_computer("name")`` in a new module of this package (every module
here is imported with it), or name your own by import path "package.module:ClassName".
Enabled by ``reward_computation.enable`` (the condensed context manager scores each finished
trajectory at the end of the rollout): see docs/multiturn_grpo.md.
"""

from agent_trainer.config.rewards import DOMAINS, FormatValidationConfig, RewardComputationConfig, SandboxLimits
from agent_trainer.trajectory_rewards.base import (
    FinishedTrajectory,
    GroundTruth,
    IOCase,
    TrajectoryReward,
    TrajectoryRewardComputer,
    get_reward_computer_cls,
    list_reward_computers,
    longest_row,
    register_reward_computer,
)
from agent_trainer.trajectory_rewards.computers import (
    BatchRewards,
    BatchTrajectoryRewardComputer,
    GRPOTrajectoryRewardComputer,
    load_ground_truth,
    make_reward_computer,
)
from agent_trainer.trajectory_rewards.sandbox import SandboxResult, run_python
from agent_trainer.common.plugins import import_package_modules

import_package_modules(__name__, __path__)  # a new reward computer is one file here (@register_reward_computer)

__all__ = [
    "DOMAINS", "FinishedTrajectory", "FormatValidationConfig", "GroundTruth", "IOCase", "RewardComputationConfig",
    "TrajectoryReward", "TrajectoryRewardComputer", "get_reward_computer_cls", "list_reward_computers", "longest_row",
    "register_reward_computer", "BatchRewards", "BatchTrajectoryRewardComputer", "GRPOTrajectoryRewardComputer",
    "load_ground_truth", "make_reward_computer", "SandboxLimits", "SandboxResult", "run_python",
]
