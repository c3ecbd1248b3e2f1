"""Keys of align-anything and RAGEN, accepted with a notice naming this project's key, or refused.

One table, :data:`TABLE`, drives the rewrite of the command line (:func:`rewrite_overrides`, before
hydra composes), the rewrite of a config file's ``train_cfgs`` / ``model_cfgs`` / ``env_cfgs``
sections (:func:`rewrite_config_sections`, when the composed config loads) and ``docs/compatibility.md`` (``python -m
launch.config_docs`` writes it; a test checks it is current). RAGEN keys that are spelled as
here (``model_path``, ``micro_batch_size_per_gpu``, ``ppo_mini_batch_size``,
``agent_proxy.max_turn``, ``algorithm.*``, ``es_manager.*``, ...) are plain config keys and need
no entry. Values are parsed as YAML scalars (``yaml.safe_load``), never evaluated.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import yaml

from agent_trainer.config.errors import hydra_literal

SECTIONS = ("train_cfgs", "model_cfgs", "env_cfgs")
"""align-anything's config sections (schema fields, so a config file may hold them; rewritten on load)."""
SEED_SECTIONS = tuple(f"{section}." for section in SECTIONS)
"""align-anything's sections: a key under them that the table lacks is refused with a pointer to the doc."""
DOC = Path(__file__).resolve().parents[2] / "docs" / "compatibility.md"


@dataclass(frozen=True)
class CompatKey:
    """One foreign key: what it becomes here (``rewrite``), or why it is refused (``refusal``)."""

    old: str
    system: str
    meaning: str
    """How the value is translated (the doc's last column)."""
    rewrite: Callable[[Any], dict[str, Any]] | None = None
    refusal: str | None = None
    alias_of: str | None = None
    """Seed 004's keys: the project key this schema key is another name of (both are set to the value)."""


def _to(key: str) -> Callable[[Any], dict[str, Any]]:
    return lambda value: {key: value}


def _moved(old: str, system: str, new: str) -> CompatKey:
    """A key that is ``new`` here under another name, its value unchanged."""
    return CompatKey(old, system, new, _to(new))


def _multi_turn(value: Any) -> dict[str, Any]:
    if value is True:
        return {}  # every run here is multi-turn; agent_proxy.max_turn sets the turns
    if value is False:
        return {"agent_proxy.max_turn": 1}
    raise ValueError(f"train_cfgs.multi_turn = {value!r} is not valid; set it to true or false")


def _kl_coeff(value: Any) -> dict[str, Any]:
    return {"algorithm.use_kl_in_reward": bool(value), "algorithm.kl_ctrl.kl_coef": value}


def _betas(value: Any) -> dict[str, Any]:
    return {"actor_rollout_ref.actor.optim.betas": value, "critic.optim.betas": value}


def _always_on(old: str) -> Callable[[Any], dict[str, Any]]:
    def rewrite(value: Any) -> dict[str, Any]:
        if value is not True:
            raise ValueError(f"{old} = {hydra_literal(value)} cannot be turned off here: this trainer always "
                             "works this way; drop the key")
        return {}
    return rewrite


def _alias(old: str, new: str) -> CompatKey:
    """A seed 004 schema key that is another name of ``new``: set alone, both take the value (null: it follows)."""
    def rewrite(value: Any) -> dict[str, Any]:
        return {old: None} if value is None else {old: value, new: value}
    return CompatKey(old, SEED4, f"{new} (and {old} itself, so the two stay one value)", rewrite, alias_of=new)


SEED_ALIASES: tuple[tuple[str, str], ...] = (
    ("algorithm.multiturn_grpo.n_trajectories_per_question", "es_manager.train.group_size"),
    ("algorithm.multiturn_grpo.max_turns_per_trajectory", "agent_proxy.max_turn"),
    ("algorithm.multiturn_grpo.max_context_length", "actor_rollout_ref.rollout.max_model_len"),
    ("multiturn_trajectory.generation.max_sequence_length", "actor_rollout_ref.rollout.max_model_len"),
    ("multiturn_trajectory.generation.max_new_tokens", "actor_rollout_ref.rollout.response_length"),
    ("multiturn_trajectory.generation.temperature", "actor_rollout_ref.rollout.temperature"),
    ("multiturn_trajectory.generation.top_p", "actor_rollout_ref.rollout.top_p"),
    ("multiturn_trajectory.generation.top_k", "actor_rollout_ref.rollout.top_k"),
)
"""(seed 004's key, this project's key): one value under two names. On the command line the seed key alone sets
both (the table below); in a config file the seed key, when set, must hold the project key's value
(``agent_trainer.checks.multiturn``; the seed configs write ``project_key: ${seed_key}``)."""

AA, RAGEN, SEED4 = "align-anything", "RAGEN", "seed 004"
TABLE: tuple[CompatKey, ...] = (
    CompatKey("train_cfgs.multi_turn", AA, "true: nothing to set (every run is multi-turn; agent_proxy.max_turn "
              "sets the turns); false: agent_proxy.max_turn=1", _multi_turn),
    CompatKey("train_cfgs.bi_level_gae", AA, "algorithm.bi_level_gae (RAGEN's spelling: true becomes "
              "algorithm.adv_estimator=bi_level_gae when the config loads)", _to("algorithm.bi_level_gae")),
    _moved("train_cfgs.high_level_gamma", AA, "algorithm.high_level_gamma"),
    _moved("train_cfgs.max_turn", AA, "agent_proxy.max_turn"),
    _moved("train_cfgs.gamma", AA, "algorithm.gamma"),
    _moved("train_cfgs.gae_lambda", AA, "algorithm.lam"),
    CompatKey("train_cfgs.kl_coeff", AA, "KL penalty in the reward: algorithm.use_kl_in_reward=(value != 0), "
              "algorithm.kl_ctrl.kl_coef=value", _kl_coeff),
    _moved("train_cfgs.update_iters", AA, "actor_rollout_ref.actor.ppo_epochs"),
    _moved("train_cfgs.clip_range_ratio", AA, "actor_rollout_ref.actor.clip_ratio"),
    _moved("train_cfgs.clip_range_value", AA, "critic.cliprange_value"),
    _moved("train_cfgs.actor_lr", AA, "actor_rollout_ref.actor.optim.lr"),
    _moved("train_cfgs.critic_lr", AA, "critic.optim.lr"),
    _moved("train_cfgs.actor_weight_decay", AA, "actor_rollout_ref.actor.optim.weight_decay"),
    _moved("train_cfgs.critic_weight_decay", AA, "critic.optim.weight_decay"),
    CompatKey("train_cfgs.adam_betas", AA, "actor_rollout_ref.actor.optim.betas and critic.optim.betas", _betas),
    _moved("train_cfgs.actor_gradient_checkpointing", AA, "actor_rollout_ref.model.enable_gradient_checkpointing"),
    _moved("train_cfgs.critic_gradient_checkpointing", AA, "critic.model.enable_gradient_checkpointing"),
    _moved("train_cfgs.seed", AA, "trainer.seed"),
    _moved("train_cfgs.eval_interval", AA, "trainer.test_freq"),
    CompatKey("train_cfgs.use_reward_model", AA, "reward_model.enable (seed 002 spells it under train_cfgs too)",
              _to("reward_model.enable")),
    CompatKey("train_cfgs.use_reward_critic", AA, "critic.enable (seed 002 spells it under train_cfgs too)",
              _to("critic.enable")),
    CompatKey("train_cfgs.epochs", AA, "refused", refusal="counts passes over a prompt dataset; this trainer "
              "counts PPO iterations: set trainer.total_training_steps"),
    CompatKey("train_cfgs.ptx_coeff", AA, "refused", refusal="there is no pretraining-mix (ptx) loss here"),
    CompatKey("train_cfgs.clip_range_score", AA, "refused", refusal="rewards are not clipped here; shape them in "
              "the environment or the reward function"),
    CompatKey("model_cfgs.actor_model_name_or_path", AA, "model_path (actor, reference and critic backbone)",
              _to("model_path")),
    _moved("model_cfgs.reward_model_name_or_path", AA, "reward_model.model.path"),
    _moved("model_cfgs.reward_critic_model_name_or_path", AA, "critic.model.path"),
    _moved("model_cfgs.model_max_length", AA, "actor_rollout_ref.rollout.max_model_len"),
    CompatKey("model_cfgs.use_reward_model", AA, "reward_model.enable (also set reward_model.model.path)",
              _to("reward_model.enable")),
    CompatKey("model_cfgs.use_reward_critic", AA, "critic.enable: true needs a GAE-family algorithm.adv_estimator "
              "(gae, bi_level_gae; the default), false one without values (e.g. grpo)", _to("critic.enable")),
    CompatKey("env_cfgs.env_name", AA, "refused", refusal="environments are named by tag: set "
              "es_manager.train.env_configs.tags=[FrozenLake3x3] (tags are listed in envs_file, config/envs.yaml)"),
    CompatKey("env_cfgs.max_episode_length", AA, "refused", refusal="an episode ends after agent_proxy.max_turn "
              "turns; set agent_proxy.max_turn (and the env tag's own limits in envs_file)"),
    CompatKey("agent_proxy.use_environment", AA, "true: nothing to set (rewards always come from the environments); "
              "false is refused", _always_on("agent_proxy.use_environment")),
    CompatKey("enable_response_mask", RAGEN, "true: nothing to set (response_mask always covers exactly the "
              "generated tokens); false is refused", _always_on("enable_response_mask")),
    CompatKey("trainer.n_gpus_per_node", RAGEN, "refused", refusal="placement is per worker group: set "
              "actor_rollout_ref.actor.fsdp.world_size (and critic.fsdp.world_size with critic.colocate=false, "
              "actor_rollout_ref.rollout.num_workers)"),
    CompatKey("trainer.nnodes", RAGEN, "refused", refusal="a run uses the Ray cluster it starts or joins "
              "(RAY_ADDRESS); size it with actor_rollout_ref.actor.fsdp.world_size"),
    CompatKey("custom_envs", RAGEN, "refused", refusal="env tags live in a YAML file: set envs_file to it "
              "(like config/envs.yaml)"),
    *(_alias(old, new) for old, new in SEED_ALIASES),
)
BY_KEY = {entry.old: entry for entry in TABLE}


def translate(key: str, value: Any) -> tuple[dict[str, Any], str] | None:
    """``(new keys and values, notice)`` for a foreign ``key``; None for this project's own keys.

    Raises ValueError with one line when the key is refused here.
    """
    entry = BY_KEY.get(key)
    if entry is None:
        if key.startswith(SEED_SECTIONS):
            raise ValueError(f"{key} is an align-anything key with no meaning here; docs/compatibility.md lists "
                             "the ones that map onto this project's keys")
        return None
    if entry.refusal is not None:
        raise ValueError(f"{key} is {entry.system}'s key and is refused here: {entry.refusal}")
    new = entry.rewrite(value)
    if not new:
        return new, (f"{key} is {entry.system}'s name; {key}={hydra_literal(value)} needs nothing set here "
                     f"({entry.meaning})")
    return new, f"{key} is {entry.system}'s name; using {', '.join(f'{k}={hydra_literal(v)}' for k, v in new.items())}"


def unknown_key_message(path: str, value: Any) -> str | None:
    """For a key the schema lacks (a dict or YAML config): the line naming this project's key, if it is foreign.

    The command line and a config's align-anything sections are rewritten; RAGEN's foreign keys in a
    config file (``enable_response_mask``, ...) must use this project's names.
    """
    leaves = _leaves(path, value)
    for key, leaf in leaves:
        try:
            translated = translate(key, leaf)
        except ValueError as err:
            return str(err)
        if translated is not None:
            new = ", ".join(f"{k}={hydra_literal(v)}" for k, v in translated[0].items()) or "nothing (drop the key)"
            return (f"{key} is {BY_KEY[key].system}'s name; in a config file write {new} instead "
                    "(docs/compatibility.md; the command line rewrites it for you)")
    return None


def rewrite_config_sections(raw: Mapping, overrides: Sequence[str] = ()) -> tuple[dict, list[str]]:
    """A composed config (plain key tree) with its align-anything sections rewritten, and the notices.

    Why after composition: hydra only merges YAML files, so ``train_cfgs.bi_level_gae: true`` in a
    config file reaches the loader as it was written; each key is translated as on the command line
    (the same notice, or the same one-line refusal) and the sections are left empty. A key that the
    command line ``overrides`` set (already under this project's name) keeps the command line's value.
    """
    raw = copy.deepcopy(dict(raw))
    from_command_line = {o.lstrip("+~").partition("=")[0] for o in overrides}
    notices = []
    for section in SECTIONS:
        values = raw.pop(section, None) or {}
        if not isinstance(values, Mapping):
            raise ValueError(f"{section} = {hydra_literal(values)} must be a section of keys "
                             "(docs/compatibility.md lists them)")
        for key, value in _leaves(section, values):
            new, notice = translate(key, value)  # a key under these sections is in the table or refused
            kept = {k: v for k, v in new.items() if k not in from_command_line}
            for k, v in kept.items():
                _set(raw, k, v)
            overridden = sorted(set(new) - set(kept))
            notices.append(notice + (f" (the command line's {', '.join(overridden)} wins)" if overridden else ""))
    return raw, notices


BI_LEVEL_GAE_ALIAS = "algorithm.bi_level_gae"
"""RAGEN's spelling of ``algorithm.adv_estimator=bi_level_gae`` (the one documented spelling); see
:func:`rewrite_bi_level_gae`."""


def rewrite_bi_level_gae(raw: Mapping) -> tuple[dict, list[str]]:
    """A composed config (plain key tree) with ``algorithm.bi_level_gae: true`` rewritten onto the estimator's name.

    ``algorithm.bi_level_gae=true`` is RAGEN's spelling of ``algorithm.adv_estimator=bi_level_gae``: with
    adv_estimator gae (or bi_level_gae) the loaded config reads ``adv_estimator: bi_level_gae`` and
    ``bi_level_gae: false``, with a notice; with any other estimator the two keys conflict and the run is refused
    in one line. Runs after composition, so a file and the command line are treated alike.
    """
    raw = dict(raw)
    algorithm = raw.get("algorithm")
    if not isinstance(algorithm, Mapping) or algorithm.get("bi_level_gae") is not True:
        return raw, []
    estimator = algorithm.get("adv_estimator", "gae")
    if estimator not in ("gae", "bi_level_gae"):
        raise ValueError(f"{BI_LEVEL_GAE_ALIAS} = true (RAGEN's spelling of algorithm.adv_estimator=bi_level_gae) "
                         f"conflicts with algorithm.adv_estimator = {hydra_literal(estimator)}; set "
                         "algorithm.adv_estimator=bi_level_gae, or drop algorithm.bi_level_gae")
    raw["algorithm"] = {**algorithm, "adv_estimator": "bi_level_gae", "bi_level_gae": False}
    return raw, [f"{BI_LEVEL_GAE_ALIAS}=true is RAGEN's spelling; using algorithm.adv_estimator=bi_level_gae"]


def _set(tree: dict, dotted: str, value: Any) -> None:
    """``tree[a][b][c] = value`` for ``dotted`` = "a.b.c", making the sections on the way."""
    *parents, leaf = dotted.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


def _leaves(path: str, value: Any) -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in _leaves(f"{path}.{k}", v)]
    return [(path, value)]


def rewrite_overrides(overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """Command-line overrides with foreign keys rewritten (``key=v`` and ``+key=v`` alike), and the notices."""
    out, notices = [], []
    named = {o.lstrip("+~").partition("=")[0] for o in overrides}
    for override in overrides:
        prefix = override[: len(override) - len(override.lstrip("+~"))]
        name, sep, text = override[len(prefix):].partition("=")
        if name.startswith("hydra.") or (not sep and prefix != "~"):
            out.append(override)
            continue
        translated = translate(name, _scalar(text)) if prefix != "~" else None
        if translated is None:
            out.append(override)
            continue
        new, notice = translated
        alias_of = BY_KEY[name].alias_of
        if alias_of in named:  # the command line sets the project key too: both stay as given (checked to agree)
            new, notice = {name: new[name]}, f"{name} is {SEED4}'s name of {alias_of}, which the command line sets too"
        out.extend(f"{k}={hydra_literal(v)}" for k, v in new.items())
        notices.append(notice)
    return out, notices


def _scalar(text: str) -> Any:
    """A command-line value as YAML reads it (``true``, ``0.95``, ``[0.9,0.99]``); the text itself if it is not YAML."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def render() -> str:
    """The Markdown page ``docs/compatibility.md``."""
    lines = [
        "# Coming from align-anything, RAGEN or seed 004",
        "",
        "Generated by `python -m launch.config_docs` from the table in `agent_trainer/config/compat.py` (do not edit",
        "by hand). On the command line (`key=value` and `+key=value` alike) each key below is rewritten onto",
        "this project's key before hydra composes, and the run logs one notice line naming the key it used,",
        "e.g. `train_cfgs.bi_level_gae is align-anything's name; using algorithm.bi_level_gae=true`. A refused",
        "key stops the run before Ray starts with one line saying what to set instead. Any other key under",
        "`train_cfgs.`, `model_cfgs.` or `env_cfgs.` is refused with a pointer to this page.",
        "",
        "A YAML config file may hold these keys too, as `train_cfgs:` / `model_cfgs:` / `env_cfgs:` sections",
        "(e.g. `config/seed_style_frozenlake.yaml`): when the composed config loads, each key is rewritten the",
        "same way, with the same notice or refusal. A key the command line sets under this project's name",
        "keeps the command line's value (the notice says so). RAGEN's other keys in the table",
        "(`enable_response_mask`, `custom_envs`, `trainer.n_gpus_per_node`, ...) are refused in a file, naming",
        "the key to write.",
        "",
        "Seed 004's keys that are another name of this project's key (`algorithm.multiturn_grpo.*`,",
        "`multiturn_trajectory.generation.*`, rows `seed 004` below) are schema keys: set alone on the command line,",
        "the seed key and this project's key both take the value; set in a config file, the seed key must hold the",
        "project key's value (the seed configs write `agent_proxy.max_turn: ${algorithm.multiturn_grpo.max_turns_per_trajectory}`),",
        "else the run is refused naming both. `multiturn_trajectory.generation.batch_size` is no alias: it must equal",
        "`es_manager.train.env_groups` x `group_size` (null: not checked).",
        "",
        "`algorithm.bi_level_gae=true` is RAGEN's spelling of `algorithm.adv_estimator=bi_level_gae`, the",
        "documented one: with `adv_estimator` gae (or bi_level_gae) the loaded config reads",
        "`adv_estimator: bi_level_gae`, with a notice; with another estimator the two conflict and the run is",
        "refused in one line.",
        "",
        "RAGEN keys spelled as here are accepted as they are: `model_path`, `micro_batch_size_per_gpu`,",
        "`ppo_mini_batch_size`, `agent_proxy.max_turn`, `agent_proxy.enable_think`, `algorithm.*`",
        "(`adv_estimator`, `bi_level_gae`, `high_level_gamma`, `gamma`, `lam`, `kl_ctrl.*`), `es_manager.*`,",
        "`actor_rollout_ref.*` and `trainer.*` keys of the same name (docs/configuration.md lists them all).",
        "",
        "Console scripts: `agent-trainer` and `train-multi-turn` are the module entry",
        "(`python -m agent_trainer.main`): `agent-trainer --config-name frozenlake train_cfgs.bi_level_gae=true`.",
        "",
        "| key | from | becomes here |",
        "| --- | --- | --- |",
    ]
    for entry in TABLE:
        becomes = f"refused: {entry.refusal}" if entry.refusal else entry.meaning
        lines.append(f"| `{entry.old}` | {entry.system} | {becomes.replace('|', chr(92) + '|')} |")
    return "\n".join(lines) + "\n"
