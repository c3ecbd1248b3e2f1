"""The evaluation entry's pieces that need no Ray: the sampled pass's config, the summary, its refusal (its arguments:
test_cli_args.py)."""

from __future__ import annotations

import pytest

from agent_trainer.es_manager import EnvTurn, EpisodeState
from agent_trainer.eval import greedy_config, sampled_config, summarize
from agent_trainer.main import compose_and_prepare


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
