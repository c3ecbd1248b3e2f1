"""One-step off-policy overlap (trainer.max_off_policy_steps=1) on the real components, against the default.

Two 2-step PPO runs from the same weights and seeds, both with the token-level rollout correction:
run B is the default loop (rollout, update, sync), run A generates step 2's batch while step 1 trains.
Step 1 is on-policy in both, so A's step 1 must equal B's exactly (the overlap changes nothing at
staleness 0); A's step 2 batch must come from the step-0 weights: its engine log-probs then differ from
the trainer's (updated) old log-probs, which the IS weights see, while B's agree to float noise. Step 1's
checkpoint, written while A held step 2's batch, must not count that batch's env reset.

Bypass mode (algorithm.rollout_correction.bypass_mode) against the loop that runs the old-log-prob forward
every step: the engine's log-probs stand in for that forward, and on this CPU build (float32 on both
sides) the update is the recomputed one up to the engine/trainer difference.
"""

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from transformers import AutoTokenizer

from agent_trainer.main import CONFIG_DIR, init_ray, prepare
from agent_trainer.trainer import AgentTrainer

pytestmark = pytest.mark.e2e
WALL_CLOCK = ("timing_s/", "_per_s")


def _train(model_path: str, run_dir: Path, *overrides: str, steps: int = 2,
           rollout_is: str = "token") -> list[dict[str, float]]:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        raw = compose("frozenlake", overrides=[
            f"model_path={model_path}", f"trainer.default_local_dir={run_dir}",
            f"trainer.total_training_steps={steps}", "trainer.test_freq=0", "trainer.val_before_train=false",
            "trainer.progress_bar=false", "trainer.log_trajectories_freq=0", "trainer.save_freq=1",
            "es_manager.train.env_groups=2", "es_manager.train.group_size=4",
            "es_manager.train.env_configs.tags=[FrozenLake3x3,Bandit]", "es_manager.train.env_configs.n_groups=[1,1]",
            "ppo_mini_batch_size=4", "micro_batch_size_per_gpu=2", "agent_proxy.max_turn=2",
            "actor_rollout_ref.rollout.response_length=16", "actor_rollout_ref.actor.optim.lr=1e-3",
            f"algorithm.rollout_correction.rollout_is={rollout_is}", *overrides,
        ])
    cfg, tags = prepare(raw)
    init_ray(cfg)
    trainer = AgentTrainer(cfg, AutoTokenizer.from_pretrained(model_path), tags)
    trainer.init_workers()
    try:
        return trainer.fit()
    finally:
        trainer.shutdown()


def test_one_step_off_policy_overlap_against_the_default_loop(tiny_model_path, tmp_path):
    default = _train(tiny_model_path, tmp_path / "default")
    overlap = _train(tiny_model_path, tmp_path / "overlap", "trainer.max_off_policy_steps=1")

    assert [m["rollout/policy_staleness"] for m in default] == [0.0, 0.0]
    assert [m["rollout/policy_staleness"] for m in overlap] == [0.0, 1.0]
    assert "timing_s/wait_prefetch" in overlap[0] and "timing_s/wait_prefetch" not in overlap[1]  # none after the last

    # step 1's checkpoint was written while step 2's batch was held: it counts only step 1's reset, as the
    # default loop's does, so a run resumed from it plays step 2 from the same initial states
    for run in ("default", "overlap"):
        state = json.loads((tmp_path / run / "global_step_1" / "trainer_state.json").read_text())
        assert state["env_resets"]["train"] == 1, (run, state["env_resets"])

    # staleness 0: the overlap's first step is the default loop's first step, bit for bit
    same = {k: v for k, v in default[0].items() if not k.startswith(WALL_CLOCK[0]) and not k.endswith(WALL_CLOCK[1])}
    assert {k: overlap[0][k] for k in same} == same

    # step 2: the default batch came from the weights after step 1, the overlap's from the step-0 weights
    diff_default = default[1]["actor/rollout_vs_actor_logprob_diff"]
    diff_overlap = overlap[1]["actor/rollout_vs_actor_logprob_diff"]
    assert diff_default < 1e-4, diff_default  # measured: 1.3e-7 default, 0.21 overlap; IS max 1.00 vs 1.91
    assert diff_overlap > 100 * max(diff_default, 1e-6), (diff_overlap, diff_default)
    assert default[1]["actor/rollout_is_max"] == pytest.approx(1.0, abs=1e-3)
    assert abs(overlap[1]["actor/rollout_is_max"] - 1.0) > 1e-3  # the IS weights see the one-step-old policy


def test_bypass_mode_skips_the_old_log_prob_forward_and_keeps_the_update(tiny_model_path, tmp_path):
    always = "actor_rollout_ref.actor.recompute_old_log_prob=always"
    recomputed = _train(tiny_model_path, tmp_path / "recomputed", always, steps=1, rollout_is="null")[0]
    bypass = _train(tiny_model_path, tmp_path / "bypass", "algorithm.rollout_correction.bypass_mode=true",
                    steps=1, rollout_is="null")[0]
    assert recomputed["perf/old_log_prob_skipped"] == 0.0 and bypass["perf/old_log_prob_skipped"] == 1.0
    assert recomputed["actor/rollout_vs_actor_logprob_diff"] < 1e-4  # float32 engine and trainer agree
    assert "actor/rollout_vs_actor_logprob_diff" not in bypass  # not measured without the trainer's forward
    assert bypass["rollout/episode_reward_mean"] == recomputed["rollout/episode_reward_mean"]  # same episodes
    # PPO's ratio is pi_theta / pi_rollout: the recomputed one up to the engine/trainer difference (its KL and
    # clipping come from the second mini-batch, after the first optimizer step)
    for key in ("actor/pg_loss", "actor/ppo_kl", "actor/pg_clipfrac", "actor/grad_norm", "critic/vf_loss"):
        assert bypass[key] == pytest.approx(recomputed[key], rel=1e-3, abs=1e-6), key
