"""Text environments for agent training: ``BaseEnv``, the registry and env tags.

Built-in environments are registered lazily by import path, so ``import envs``
imports no environment (nor gymnasium, textworld, ...) until one is made::

    import envs
    env = envs.make_env("frozen_lake", size=4)          # by registered name
    env = envs.make_env("FrozenLake")                   # by tag in config/envs.yaml
    obs = env.reset(seed=0)
    obs, reward, done, info = env.step("Right")
"""

from envs.base import BaseEnv, EmptyConfig, ServiceError, make_info, parse_choice
from envs.registry import (
    EnvTagConfig,
    build_config,
    get_env_classes,
    list_envs,
    load_env_tags,
    make_env,
    parse_env_tags,
    register_env,
)

_BUILTIN = {
    "frozen_lake": "envs.frozen_lake:FrozenLakeEnv",
    "gymnasium": "envs.gym_wrapper:GymnasiumTextEnv",
    "sokoban": "envs.sokoban:SokobanEnv",
    "bandit": "envs.bandit:BanditEnv",
    "countdown": "envs.countdown:CountdownEnv",
    "metamathqa": "envs.metamathqa:MetaMathQAEnv",
    "prompt_dataset": "envs.dataset_env:PromptDatasetEnv",
    "webshop": "envs.webshop:WebShopEnv",
    "textworld": "envs.text_world:TextWorldEnv",
    "alfworld": "envs.alfworld_env:ALFWorldEnv",
    "slow_frozen_lake": "envs.slow_env:SlowFrozenLakeEnv",  # test env: simulated slow backend (bench P6)
    "openenv": "envs.openenv_env:OpenEnvEnv",  # an OpenEnv server over HTTP (docs/environments.md, "Services")
}
for _name, _path in _BUILTIN.items():
    register_env(_name, _path)

__all__ = [
    "BaseEnv",
    "EmptyConfig",
    "EnvTagConfig",
    "build_config",
    "get_env_classes",
    "list_envs",
    "load_env_tags",
    "make_env",
    "make_info",
    "parse_choice",
    "parse_env_tags",
    "register_env",
    "ServiceError",
]
