"""One-step off-policy overlap (trainer.max_off_policy_steps=1) on the real components, against the default.

Two 2-step PPO runs from the same weights and seeds, both with the token-level rollout correction:
run B is the default loop (rollout, update, sync), run A generates step 2's batch while step 1 trains.
Step 1 is on-policy in both, so A's step 1 must equal B's exactly (the overlap changes nothing at
staleness 0); A's step 2 batch must come from the step-0 weights: its engine log-probs then differ from
the trainer's (updated) old log-probs, which the IS weights see, while B's agree to float noise. Step 1's
checkpoint, written while A held step 2's batch, must not count that batch's env reset.

Bypass mode (algorithm.rollout_correction.bypass_mode) against the default loop's step 1, which runs the
old-log-prob forward: the engine's log-probs stand in for that forward, and on this CPU build (float32 on both
sides) the update is the recomputed one up to the engine/trainer difference.
"""

import json
from pathlib import Path

import pytest

from e2e_runs import train_here

pytestmark = [pytest.mark.e2e, pytest.mark.shared_cluster]
WALL_CLOCK = ("timing_s/", "_per_s")


def _train(model_path: str, run_dir: Path, *overrides: str, steps: int = 2,
           rollout_is: str = "token") -> list[dict[str, float]]:
    return train_here("frozenlake", model_path, run_dir,
                      f"trainer.total_training_steps={steps}", "trainer.test_freq=0", "trainer.val_before_train=false",
                      "trainer.progress_bar=false", "trainer.log_trajectories_freq=0", "trainer.save_freq=1",
                      "es_manager.train.env_groups=2", "es_manager.train.group_size=4",
                      "es_manager.train.env_configs.tags=[FrozenLake3x3,Bandit]",
                      "es_manager.train.env_configs.n_groups=[1,1]", "ppo_mini_batch_size=4",
                      "micro_batch_size_per_gpu=2", "agent_proxy.max_turn=2",
                      "actor_rollout_ref.rollout.response_length=16", "actor_rollout_ref.actor.optim.lr=1e-3",
                      f"algorithm.rollout_correction.rollout_is={rollout_is}", *overrides)[1]


@pytest.fixture(scope="module")
def default(tiny_model_path, tmp_path_factory) -> tuple[Path, list[dict[str, float]]]:
    """The default loop, 2 steps: its run directory and metrics (both tests compare against it)."""
    run_dir = tmp_path_factory.mktemp("default")
    return run_dir, _train(tiny_model_path, run_dir)


def test_one_step_off_policy_overlap_against_the_default_loop(tiny_model_path, tmp_path, default):
    default_dir, default = default
    overlap = _train(tiny_model_path, tmp_path / "overlap", "trainer.max_off_policy_steps=1")

    assert [m["rollout/policy_staleness"] for m in default] == [0.0, 0.0]
    assert [m["rollout/policy_staleness"] for m in overlap] == [0.0, 1.0]
    assert "timing_s/wait_prefetch" in overlap[0] and "timing_s/wait_prefetch" not in overlap[1]  # none after the last

    # step 1's checkpoint was written while step 2's batch was held: it counts only step 1's reset, as the
    # default loop's does, so a run resumed from it plays step 2 from the same initial states
    for run_dir in (default_dir, tmp_path / "overlap"):
        state = json.loads((run_dir / "global_step_1" / "trainer_state.json").read_text())
        assert state["env_resets"]["train"] == 1, (run_dir, state["env_resets"])

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


def test_bypass_mode_skips_the_old_log_prob_forward_and_keeps_the_update(tiny_model_path, tmp_path, default):
    # the default loop's step 1 ran the old-log-prob forward (its token-level IS needs the trainer's log-probs);
    # its IS weights are within 1e-4 of 1 at staleness 0 (asserted below), well inside the 1e-3 compared
    recomputed = default[1][0]
    bypass = _train(tiny_model_path, tmp_path / "bypass", "algorithm.rollout_correction.bypass_mode=true",
                    steps=1, rollout_is="null")[0]
    assert recomputed["perf/old_log_prob_skipped"] == 0.0 and bypass["perf/old_log_prob_skipped"] == 1.0
    assert recomputed["actor/rollout_vs_actor_logprob_diff"] < 1e-4  # float32 engine and trainer agree
    assert recomputed["actor/rollout_is_max"] == pytest.approx(1.0, abs=1e-4)
    assert "actor/rollout_vs_actor_logprob_diff" not in bypass  # not measured without the trainer's forward
    assert bypass["rollout/episode_reward_mean"] == recomputed["rollout/episode_reward_mean"]  # same episodes
    # PPO's ratio is pi_theta / pi_rollout: the recomputed one up to the engine/trainer difference (its KL and
    # clipping come from the second mini-batch, after the first optimizer step)
    for key in ("actor/pg_loss", "actor/ppo_kl", "actor/pg_clipfrac", "actor/grad_norm", "critic/vf_loss"):
        assert bypass[key] == pytest.approx(recomputed[key], rel=1e-3, abs=1e-6), key
