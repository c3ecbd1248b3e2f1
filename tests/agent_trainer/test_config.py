"""Config loading: typed schema, interpolation, resolved defaults, clear errors naming the key and the fix.

The table of malformed configs is tests/agent_trainer/test_config_errors.py."""

import contextlib
import logging

import pytest
from hydra import compose, initialize_config_dir

from agent_trainer import core_algos
from agent_trainer.checks.load import load_config
from agent_trainer.checks.prepare import CONFIG_DIR, prepare


def _compose(*overrides: str, name: str = "frozenlake"):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(name, overrides=list(overrides))


def test_frozenlake_config_loads_and_interpolates():
    cfg = load_config(_compose("model_path=/some/model"))
    assert cfg.actor_rollout_ref.model.path == "/some/model" and cfg.critic.model.path == "/some/model"
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == cfg.ppo_mini_batch_size
    assert core_algos.critic_enabled(cfg) and not cfg.ref_enabled
    assert cfg.trainer.default_local_dir.endswith("agent_trainer/frozenlake_ppo")


def test_estimator_selection():
    cfg = load_config(_compose("algorithm.bi_level_gae=true"))
    assert core_algos.estimator(cfg.algorithm) == "bi_level_gae" and core_algos.critic_enabled(cfg)
    cfg = load_config(_compose("algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=true"))
    assert core_algos.estimator(cfg.algorithm) == "grpo" and not core_algos.critic_enabled(cfg) and cfg.ref_enabled


@pytest.mark.parametrize(
    "override, expected",
    [
        ("algorithm.adv_estimator=ppo", "algorithm.adv_estimator"),
        ("actor_rollout_ref.actor.loss_agg_mode=mean", "actor_rollout_ref.actor.loss_agg_mode"),
        ("actor_rollout_ref.actor.kl_loss_type=k9", "actor_rollout_ref.actor.kl_loss_type"),
        ("ppo_mini_batch_size=7", "ppo_mini_batch_size (7) must divide the rows per step"),
        ("micro_batch_size_per_gpu=3", "ppo_micro_batch_size_per_gpu (3) must divide"),
        ("actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.name"),
        ("trainer.totl_steps=3", "totl_steps"),
        ("trainer.total_training_steps=abc", "total_training_steps"),
        ("es_manager.train.env_configs.n_groups=[3]", "n_groups"),
        ("critic.enable=false", "critic.enable"),
    ],
)
def test_bad_values_name_the_key(override, expected):
    # hydra rejects unknown keys and wrong types while composing; load_config the cross-field rules
    with pytest.raises(Exception) as err:
        load_config(_compose(override))
    assert isinstance(err.value, ValueError) or "ConfigCompositionException" in type(err.value).__name__
    assert expected in str(err.value)


def test_unknown_env_tag_is_reported_before_workers_start(tmp_path):
    with pytest.raises(ValueError, match="NoSuchEnv"):
        prepare(_compose("es_manager.train.env_configs.tags=[NoSuchEnv]", f"model_path={tmp_path}"))


def test_missing_model_names_the_fix():
    with pytest.raises(ValueError, match="make model"):
        prepare(_compose("model_path=models/definitely-missing"))


def test_configuration_doc_is_current():
    from launch.config_docs import OUT, render

    assert OUT.read_text() == render(), "docs/configuration.md is stale: run python -m launch.config_docs"


def test_grpo_multiturn_config_selects_condensed_per_turn_rows():
    cfg = load_config(_compose(name="frozenlake_grpo_multiturn"))
    assert core_algos.estimator(cfg.algorithm) == "grpo_multiturn" and cfg.ctx_manager.mode == "condensed"
    assert cfg.ctx_manager.keep_last_n_turns == 2 and not core_algos.critic_enabled(cfg)
    # rows per step vary in condensed mode, so the mini-batch need not divide the episode count
    load_config(_compose("ppo_mini_batch_size=24", name="frozenlake_grpo_multiturn"))


@pytest.mark.parametrize(
    "name, overrides, expected",
    [
        # grpo_multiturn on one row per episode would silently be plain grpo
        ("frozenlake_grpo", ["algorithm.adv_estimator=grpo_multiturn"], "set ctx_manager.mode=condensed"),
        ("frozenlake", ["ctx_manager.mode=condensed"], "algorithm.adv_estimator = 'gae'"),
        ("frozenlake_grpo", ["ctx_manager.mode=condensed"], "set algorithm.adv_estimator=grpo_multiturn"),
        ("frozenlake_bilevel", ["ctx_manager.mode=condensed"], "value bootstrap"),
        ("frozenlake", ["ctx_manager.mode=compact"], "ctx_manager.mode = 'compact' is not one of ['full', 'condensed']"),
        ("frozenlake_grpo_multiturn", ["ctx_manager.keep_last_n_turns=-1"], "ctx_manager.keep_last_n_turns = -1"),
        ("frozenlake_grpo_multiturn", ["micro_batch_size_per_gpu=3"], "ppo_micro_batch_size_per_gpu (3) must divide"),
    ],
)
def test_context_mode_and_estimator_must_agree(name, overrides, expected):
    with pytest.raises(ValueError) as err:
        load_config(_compose(*overrides, name=name))
    assert expected in str(err.value)


@pytest.mark.parametrize(
    "override, expected",
    [
        ("agent_proxy.reward_normalization.grouping=episode", "agent_proxy.reward_normalization.grouping = 'episode'"),
        ("agent_proxy.reward_normalization.method=zscore", "['identity', 'mean', 'mean_std', 'asym_clip']"),
        ("actor_rollout_ref.rollout.rollout_filter_strategy=std", "['top_k', 'top_p', 'min_p']"),
        ("actor_rollout_ref.rollout.rollout_filter_value=0", "must lie in (0, 1] for rollout_filter_strategy 'top_k'"),
        ("actor_rollout_ref.rollout.rollout_filter_value=1.5", "rollout_filter_value = 1.5"),
    ],
)
def test_shaping_choices_are_validated(override, expected):
    with pytest.raises(ValueError) as err:
        load_config(_compose(override))
    assert expected in str(err.value)


def test_shaping_values_that_load():
    cfg = load_config(_compose("actor_rollout_ref.rollout.rollout_filter_strategy=min_p",
                               "actor_rollout_ref.rollout.rollout_filter_value=0",
                               "agent_proxy.reward_normalization.grouping=inductive",
                               "agent_proxy.reward_normalization.method=asym_clip"))
    assert cfg.agent_proxy.reward_normalization.method == "asym_clip"
    # filtering ranks groups by their reward std: groups of one would be dropped arbitrarily
    with pytest.raises(ValueError, match="group_size >= 2"):
        load_config(_compose("es_manager.train.group_size=1", "actor_rollout_ref.rollout.rollout_filter_value=0.25",
                             "ppo_mini_batch_size=8"))


@pytest.mark.parametrize("overrides, ratios, agg", [
    ([], (0.2, 0.28), "token-mean"),  # StarPO-S clip-higher
    (["actor_rollout_ref.actor.clip_ratio=0.1"], (0.1, 0.1), "token-mean"),  # verl: both sides fall back to it
    (["actor_rollout_ref.actor.clip_ratio=0.1", "actor_rollout_ref.actor.clip_ratio_high=0.3"], (0.1, 0.3),
     "token-mean"),
    (["actor_rollout_ref.actor.policy_loss_mode=gspo"], (3e-4, 4e-4), "seq-mean-token-mean"),  # the GSPO paper
    (["actor_rollout_ref.actor.policy_loss_mode=gspo", "actor_rollout_ref.actor.clip_ratio_high=1e-3",
      "actor_rollout_ref.actor.loss_agg_mode=token-mean"], (3e-4, 1e-3), "token-mean"),  # set values are kept
])
def test_clip_ratios_and_loss_aggregation_resolve(overrides, ratios, agg):
    actor = load_config(_compose(*overrides)).actor_rollout_ref.actor
    assert actor.clip_ratios() == pytest.approx(ratios) and actor.loss_agg() == agg


def test_env_seed_follows_the_run_seed_unless_set():
    assert load_config(_compose("trainer.seed=7")).es_manager.seed == 7
    assert load_config(_compose("trainer.seed=7", "es_manager.seed=3")).es_manager.seed == 3
    assert load_config({"trainer": {"seed": 5}}).es_manager.seed == 5  # the dataclass default, without base.yaml


def test_plus_form_and_dicts_are_checked_against_the_schema():
    with pytest.raises(ValueError, match=r"^trainer.totl_steps is not a config key .*did you mean "
                                         r"trainer.total_training_steps\?$"):
        load_config(_compose("+trainer.totl_steps=3"))
    with pytest.raises(ValueError, match=r"^critic.optim.learning_rate is not a config key"):
        load_config({"critic": {"optim": {"learning_rate": 1e-3}}})


def test_the_actor_passes_the_resolved_clip_ratios_to_its_loss(tiny_model_path):
    """agent_trainer/workers/actor.py hands the policy loss clip_ratios() and loss_agg(), not the raw (possibly null)
    keys."""
    import torch

    from agent_trainer.common.batch import TensorBatch
    from agent_trainer.config import ActorConfig, FSDPConfig, ModelConfig
    from agent_trainer.workers.actor import ActorWorker

    actor = ActorConfig(ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=2, policy_loss_mode="gspo",
                        clip_ratio_high=1e-3, fsdp=FSDPConfig(world_size=1))
    worker = ActorWorker(rank=0, world_size=1, model=ModelConfig(path=tiny_model_path), actor=actor, device="cpu")
    worker.init_model()
    seen = []

    def spy(**kwargs):
        seen.append(kwargs)
        return real_loss(**kwargs)

    real_loss, worker.policy_loss_fn = worker.policy_loss_fn, spy
    B, T = 2, 8
    mask = torch.zeros(B, T, dtype=torch.long)
    mask[:, 4:] = 1
    batch = TensorBatch({"input_ids": torch.randint(3, 200, (B, T)),
                         "attention_mask": torch.ones(B, T, dtype=torch.long),
                         "position_ids": torch.arange(T).expand(B, T).clone(), "response_mask": mask,
                         "advantages": torch.ones(B, T) * mask})
    worker.update_actor(batch.update(worker.compute_log_prob(batch)))
    assert seen and all(k["cliprange_low"] == 3e-4 and k["cliprange_high"] == 1e-3 for k in seen)
    assert all(k["loss_agg_mode"] == "seq-mean-token-mean" for k in seen)


def test_the_hydra_entry_point_runs_a_valid_config(tiny_model_path, tmp_path, monkeypatch):
    """main() composes, validates and calls train; HYDRA_FULL_ERROR is back to unset for the run."""
    import os
    import sys

    from agent_trainer import main as entry

    calls = []
    monkeypatch.setattr(entry, "train", lambda cfg, tags: calls.append((cfg, "HYDRA_FULL_ERROR" in os.environ)))
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(sys, "argv", ["agent_trainer.main", f"hydra.run.dir={tmp_path}", "hydra.output_subdir=null",
                                      "hydra/job_logging=disabled", "hydra/hydra_logging=disabled",
                                      f"model_path={tiny_model_path}", "trainer.total_training_steps=3"])
    with _logging_restored():  # hydra reconfigures logging (here: disables it) for the process
        entry.main()
    assert len(calls) == 1 and calls[0][0].trainer.total_training_steps == 3 and calls[0][1] is False
    assert "HYDRA_FULL_ERROR" not in os.environ


@contextlib.contextmanager
def _logging_restored():
    """Undo what hydra's logging set-up changes: root level and handlers, loggers' disabled flags and levels."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    loggers = {name: (lg.disabled, lg.level, lg.propagate) for name, lg in logging.Logger.manager.loggerDict.items()
               if isinstance(lg, logging.Logger)}
    try:
        yield
    finally:
        root.setLevel(level)
        root.handlers[:] = handlers
        for name, lg in logging.Logger.manager.loggerDict.items():
            if isinstance(lg, logging.Logger):
                lg.disabled, lg.level, lg.propagate = loggers.get(name, (False, logging.NOTSET, True))


R = "actor_rollout_ref.rollout."


@pytest.mark.parametrize("overrides, words", [
    ([f"{R}name=hf", f"{R}gpu_memory_utilization=0.7"],
     "gpu_memory_utilization = 0.7 is read by the vllm engine only, and actor_rollout_ref.rollout.name = 'hf' "
     "ignores it; drop it (or set rollout.name=vllm)"),
    ([f"{R}name=hf", f"{R}kv_cache_space_gib=1.0"], "kv_cache_space_gib = 1.0 is read by the vllm engine only"),
    ([f"{R}name=hf", f"{R}tensor_model_parallel_size=2", "trainer.device=cuda"],
     "tensor_model_parallel_size = 2 needs rollout.name=vllm"),
    (["trainer.device=cpu", f"{R}gpu_memory_utilization=0.7"],
     "gpu_memory_utilization = 0.7 is read on cuda only, and the run's engines are on cpu"),
    (["trainer.device=cuda", f"{R}kv_cache_space_gib=1.0"],
     "kv_cache_space_gib = 1.0 is read on cpu only, and the run's engines are on cuda"),
    (["trainer.device=cuda", f"{R}num_threads=2"], "num_threads = 2 is read on cpu only"),
])
def test_an_engine_key_the_chosen_engine_or_device_ignores_is_refused_in_one_line(overrides, words):
    with pytest.raises(ValueError) as err:
        load_config(_compose(*overrides))
    assert words in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_engine_keys_of_the_chosen_engine_and_device_are_accepted_and_auto_is_checked_once_joined():
    from agent_trainer.workers.build import check_device
    from agent_trainer.workers.worker_group import PlacementError

    load_config(_compose(f"{R}name=hf"))  # every default is fine for either engine
    load_config(_compose(f"{R}kv_cache_space_gib=1.0", f"{R}num_threads=2", "trainer.device=cpu"))
    gpu = load_config(_compose(f"{R}gpu_memory_utilization=0.7"))  # trainer.device=auto: the cluster decides
    check_device(gpu, "cuda", {"CPU": 8.0, "GPU": 2.0})
    with pytest.raises(PlacementError, match="gpu_memory_utilization = 0.7 is read on cuda only"):
        check_device(gpu, "cpu", {"CPU": 8.0})
