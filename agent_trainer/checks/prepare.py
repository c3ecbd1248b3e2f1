"""From the command line to a checked config: the one loader of ``main``, ``sft``, ``eval`` and ``plan``, and every
start-up check in the order it runs, all before ``ray.init``.

1. :func:`compose`: hydra composes ``config/<name>.yaml`` with the ``key=value`` overrides onto the typed schema
   (align-anything / RAGEN keys rewritten first, :func:`rewrite_compat`; ``main`` lets ``@hydra.main`` compose).
2. :func:`prepare`:

   * the schema merge and every cross-field, closed-choice and registry-name check (``checks.load.load_config``:
     ``checks/rl.py``, ``checks/rules.py`` and the modules they call);
   * the env tags: ``envs_file`` and the prompt datasets' tags (``checks.inputs.load_envs_file``,
     ``agent_trainer.episode.prompt_data``);
   * what the file system and the models' ``config.json`` say (``checks.inputs.check_inputs``);
   * every env tag's server answers (``checks.services``);
   * ``trainer.gpu_memory_gib``: the per-GPU memory plan (``checks.memory``);
   * the prompt datasets load and fit ``data.max_prompt_length`` (``checks.datasets``);
   * each split's environments build, reset and step (``checks.preflight``).
3. Per entry point: ``main`` runs its ``check_local_placement`` (the workers fit the local cluster's CPUs), then
   the trainer decides where the run starts (``trainer.resume_mode``); ``eval`` runs ``checks.rl.check_eval``;
   ``sft`` checks its own config first (``checks.load.load_sft_config``), prepares the RL config it names
   (``rl_config``) here, then ``checks.sft.check_against_rl``; ``plan`` prints the plan even when
   ``trainer.gpu_memory_gib`` would refuse it.

Each check raises ``ValueError`` with one line naming the key, the value and the fix; an entry point turns any of
:data:`CONFIG_ERRORS` into that line on stderr (:func:`refusal`) and exits non-zero.

This module sits above the other checks: the memory plan is the trainer's (docs/architecture.md, "Layers").
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Sequence

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from agent_trainer.checks.datasets import check_datasets
from agent_trainer.checks.inputs import check_inputs, load_envs_file
from agent_trainer.checks.load import load_config
from agent_trainer.checks.memory import check_gpu_memory
from agent_trainer.checks.preflight import preflight_envs
from agent_trainer.checks.services import check_services
from agent_trainer.config import AgentTrainerConfig, compat, config_schema
from agent_trainer.config import errors as config_errors
from agent_trainer.config.sft import SFTConfig
from agent_trainer.episode.prompt_data import dataset_env_tags

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parents[2] / "config"
"""The repository's ``config/``: every ``--config-name`` and ``config/envs.yaml``."""

# base.yaml lists this schema first in its defaults, so every typed key can be overridden
# without "+" and hydra rejects unknown keys and wrong types while composing. "+key=value"
# still adds a key the schema lacks; load_config refuses it (agent_trainer/config/errors.py).
ConfigStore.instance().store(name="agent_trainer_schema", node=AgentTrainerConfig)
ConfigStore.instance().store(name="sft_schema", node=SFTConfig)  # the sft_*.yaml configs build on it

CONFIG_ERRORS = (ValueError, HydraException, OmegaConfBaseException)
"""What a config mistake raises before Ray starts: hydra's composition, OmegaConf's typing, the checks."""


def compose(config_name: str, overrides: Sequence[str] = (), config_dir: str | Path = CONFIG_DIR) -> DictConfig:
    """hydra's composition of ``<config_dir>/<config_name>.yaml`` with ``key=value`` overrides (no run folder, no
    change of directory); hydra's and OmegaConf's errors propagate (:data:`CONFIG_ERRORS`)."""
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return hydra_compose(config_name, overrides=list(overrides))


def rewrite_compat(overrides: Sequence[str]) -> list[str]:
    """The overrides with align-anything / RAGEN keys rewritten to ours, each rewrite logged
    (``agent_trainer.config.compat``, docs/compatibility.md); a refused key raises ValueError."""
    rewritten, notices = compat.rewrite_overrides(overrides)
    for notice in notices:
        logger.warning(notice)
    return rewritten


def prepare(raw_cfg: DictConfig | dict, overrides: Sequence[str] = ()) -> tuple[AgentTrainerConfig, dict]:
    """Every start-up check of an RL config (the module's docstring lists them in order); returns the typed config
    and its env tags. Raises ValueError naming the key or the tag and the fix.

    ``overrides``: the command line's, which win over a config file's align-anything sections (compat.py).
    """
    cfg = load_config(raw_cfg, overrides)
    if not cfg.envs_file:
        cfg.envs_file = str(CONFIG_DIR / "envs.yaml")
    env_tags = load_envs_file(cfg.envs_file)
    env_tags.update(dataset_env_tags(cfg))  # data.train_files / val_files as prompt_dataset tags
    check_inputs(cfg, env_tags)
    check_services(cfg, env_tags)  # an env tag's server (env_type openenv) answers with its key
    check_gpu_memory(cfg)  # trainer.gpu_memory_gib: the per-GPU memory plan (docs/cluster.md)
    if cfg.data.train_files:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.actor_rollout_ref.model.path)
        check_datasets(cfg, env_tags, lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"]))
    seconds = preflight_envs(cfg, env_tags)  # each split's tag built, reset and stepped (es_manager.preflight)
    if seconds:
        logger.debug("env preflight: %s", ", ".join(f"{tag} {s:.3f} s" for tag, s in seconds.items()))
    return cfg, env_tags


def compose_and_prepare(overrides: Sequence[str] = (), config_name: str = "frozenlake",
                        edit: Callable[[DictConfig], None] | None = None) -> tuple[AgentTrainerConfig, dict]:
    """:func:`compose` then :func:`prepare`: what every entry point does before ``ray.init`` (``main`` through
    ``@hydra.main``), for a config name and overrides (also tests, notebooks, benchmarks).

    ``edit``: a change to the composed config before it is checked (``plan`` reads and clears
    trainer.gpu_memory_gib). A mistake raises SystemExit with the one line the command line prints.
    """
    try:
        overrides = rewrite_compat(overrides)
        raw = compose(config_name, overrides)
        if edit is not None:
            edit(raw)
        return prepare(raw, overrides)
    except CONFIG_ERRORS as err:
        raise SystemExit(refusal(err, overrides)) from None


def refusal(err: BaseException, overrides: Sequence[str] = ()) -> str:
    """The one line a config mistake exits with."""
    return f"agent-trainer: {config_errors.one_line(err, config_schema(), overrides)}"
