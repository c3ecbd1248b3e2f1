"""The evaluation entry's pieces that need no Ray: the sampled pass's config, the summary, its refusal (its arguments:
test_cli_args.py)."""

from __future__ import annotations

import os

import pytest

from agent_trainer.episode.es_manager import EnvTurn, EpisodeState
from agent_trainer.eval import greedy_config, sampled_config, summarize
from agent_trainer.checks.prepare import compose_and_prepare


def test_the_sampled_config(tiny_model_path):
    cfg, _ = compose_and_prepare([f"model_path={tiny_model_path}", "eval.k=3",
                                  "actor_rollout_ref.rollout.temperature=0.7"])
    before = (cfg.es_manager.val.group_size, cfg.actor_rollout_ref.rollout.val_kwargs.temperature)
    sampled = sampled_config(cfg)
    assert sampled.es_manager.val.group_size == 3 and sampled.actor_rollout_ref.rollout.val_kwargs.temperature == 0.7
    greedy = greedy_config(cfg)
    assert greedy.es_manager.val.group_size == 1 and greedy.actor_rollout_ref.rollout.val_kwargs.temperature == 0.0
    assert (cfg.es_manager.val.group_size, cfg.actor_rollout_ref.rollout.val_kwargs.temperature) == before  # a copy
    assert cfg.eval.output_dir == f"{cfg.trainer.default_local_dir}/eval"


def test_summary_per_tag_with_pass_at_group():
    def state(tag, success, group_ok, rewards):
        return EpisodeState(env_id=0, group_id=0, tag=tag, history=[EnvTurn("", "", [], r, {}) for r in rewards],
                            penalty=0.0, final_observation="",
                            metrics={"success": float(success), "pass@group": float(group_ok)})

    states = [state("A", 1, 1, [0.0, 1.0]), state("A", 0, 1, [-0.1]), state("B", 0, 0, [0.0])]
    report = summarize(states, "pass@2")
    assert report["per_tag"]["A"] == {"episodes": 2, "success_rate": 0.5, "episode_reward_mean": 0.45, "pass@2": 1.0}
    assert report["success_rate"] == pytest.approx(1 / 3) and report["per_tag"]["B"]["pass@2"] == 0.0
    assert "pass@2" not in summarize(states)["per_tag"]["A"]


def test_k_samples_at_temperature_zero_are_refused_in_one_line(tiny_model_path, capsys):
    from agent_trainer.eval import main

    with pytest.raises(SystemExit) as exit_info:
        main([f"model_path={tiny_model_path}", "eval.k=4", "actor_rollout_ref.rollout.temperature=0"])
    message = str(exit_info.value)
    assert message.startswith("agent-trainer: eval.k = 4") and "temperature=1.0 or eval.k=0" in message
    assert "\n" not in message


def saved_checkpoint(tmp_path, tiny_model_path, overrides, step=2):
    """A run folder with one checkpoint as the trainer leaves it: config.yaml, trainer_state.json, an HF actor."""
    import shutil

    from omegaconf import OmegaConf

    from agent_trainer.common.checkpoint import LATEST_FILE, TrainerState

    run_dir = tmp_path / "run"
    cfg, _ = compose_and_prepare([f"model_path={tiny_model_path}", f"trainer.default_local_dir={run_dir}",
                                  *overrides])
    folder = run_dir / f"global_step_{step}"
    shutil.copytree(tiny_model_path, folder / "actor")
    OmegaConf.save(OmegaConf.structured(cfg), folder / "config.yaml")
    TrainerState(global_step=step).save(folder)
    (run_dir / LATEST_FILE).write_text(str(step))
    return run_dir, folder


TRAINING = ["es_manager.val.env_groups=2", "es_manager.val.env_configs.n_groups=[2]", "agent_proxy.max_turn=2",
            "actor_rollout_ref.rollout.response_length=24", "micro_batch_size_per_gpu=2", "trainer.seed=7"]


def test_a_checkpoint_is_evaluated_with_its_runs_config_and_writes_beside_it(tmp_path, tiny_model_path):
    from agent_trainer.eval import compose_checkpoint, find_checkpoint

    run_dir, folder = saved_checkpoint(tmp_path, tiny_model_path, TRAINING)
    assert find_checkpoint(str(run_dir)) == folder == find_checkpoint(str(folder))  # a run folder: its newest
    assert find_checkpoint(os.path.relpath(folder)) == folder  # absolute: the report names it wherever it runs
    cfg, _ = compose_checkpoint(folder, ["eval.k=2"])
    assert cfg.actor_rollout_ref.model.path == str(folder / "actor") and cfg.eval.output_dir == str(folder / "eval")
    assert (cfg.es_manager.val.env_groups, cfg.agent_proxy.max_turn, cfg.actor_rollout_ref.rollout.response_length,
            cfg.es_manager.seed) == (2, 2, 24, 7)  # the training overrides, not repeated
    assert cfg.eval.k == 2 and cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 2


def test_overrides_apply_on_top_and_aliases_still_follow(tmp_path, tiny_model_path):
    from agent_trainer.eval import compose_checkpoint

    _, folder = saved_checkpoint(tmp_path, tiny_model_path, TRAINING)
    out = tmp_path / "elsewhere"
    cfg, _ = compose_checkpoint(folder, ["agent_proxy.max_turn=3", "trainer.seed=11", f"eval.output_dir={out}",
                                         "micro_batch_size_per_gpu=1"])
    assert cfg.agent_proxy.max_turn == 3 and cfg.eval.output_dir == str(out)
    assert cfg.es_manager.seed == 11  # follows trainer.seed as in training (config/base.yaml)
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 1 and cfg.critic.ppo_micro_batch_size_per_gpu == 1
    assert cfg.es_manager.val.env_groups == 2
    cfg, _ = compose_checkpoint(folder, [f"model_path={tiny_model_path}"])
    assert cfg.actor_rollout_ref.model.path == tiny_model_path  # another model, on the run's config
    with pytest.raises(SystemExit) as exit_info:
        compose_checkpoint(folder, ["agent_proxy.max_turns=3"])
    assert str(exit_info.value).startswith("agent-trainer: ") and "agent_proxy.max_turns" in str(exit_info.value)


def test_checkpoint_mistakes_are_refused_in_one_line(tmp_path, tiny_model_path):
    from agent_trainer.eval import main

    _, folder = saved_checkpoint(tmp_path, tiny_model_path, [])
    for argv, words in ([["--checkpoint", str(tmp_path / "nothing")], "not a checkpoint folder"],
                        [["--checkpoint", str(folder), "--config-name", "frozenlake"], "drop --config-name"],
                        [["--checkpoint"], "needs a folder"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        message = str(exit_info.value)
        assert message.startswith("agent-trainer eval: ") and words in message and "\n" not in message, message
    (folder / "actor" / "model.safetensors").unlink()
    with pytest.raises(SystemExit) as exit_info:
        main(["--checkpoint", str(folder)])
    assert "trainer.save_hf_model=false" in str(exit_info.value) and "agent_trainer.export" in str(exit_info.value)


def test_a_checkpoints_actor_as_model_path_writes_beside_the_checkpoint(tmp_path, tiny_model_path):
    from agent_trainer.eval import beside_the_checkpoint

    _, folder = saved_checkpoint(tmp_path, tiny_model_path, [])
    cfg, _ = compose_and_prepare([f"model_path={folder / 'actor'}", f"trainer.default_local_dir={tmp_path / 'x'}"])
    beside_the_checkpoint(cfg)
    assert cfg.eval.output_dir == str(folder / "eval")
    cfg, _ = compose_and_prepare([f"model_path={folder / 'actor'}", f"eval.output_dir={tmp_path / 'mine'}"])
    beside_the_checkpoint(cfg)
    assert cfg.eval.output_dir == str(tmp_path / "mine")  # given: kept
    cfg, _ = compose_and_prepare([f"model_path={tiny_model_path}"])
    beside_the_checkpoint(cfg)
    assert cfg.eval.output_dir == f"{cfg.trainer.default_local_dir}/eval"  # not a checkpoint: the config's
