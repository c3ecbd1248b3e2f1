"""The shipped configs with command-line overrides (real workers), the metrics file, and a refused config.

The real command line trains in test_rewards_e2e (the align-anything config file, with the options this
module's command-line run had: adaptive KL-in-reward, the reference in a group of its own, bf16), in the
operations, resume and process-fault tests.
"""

import math
import subprocess
import sys
from pathlib import Path

import pytest

from e2e_runs import metrics_records, train_here

REPO = Path(__file__).resolve().parents[2]


TINY = ["trainer.total_training_steps=1", "trainer.test_freq=0", "agent_proxy.max_turn=2",
        "es_manager.train.env_groups=2", "es_manager.train.env_configs.n_groups=[2]", "ppo_mini_batch_size=8",
        "actor_rollout_ref.rollout.response_length=16"]


def check_records(records: list[dict], extra: list[str], expect_critic: bool,
                  env_tag: str = "FrozenLakeDescribed") -> None:
    """The run's metrics: every step logged once, finite, from the algorithm and env tag the config names."""
    record = records[-1]
    steps = 2 if "trainer.total_training_steps=2" in extra else 1
    assert [r["step"] for r in records] == list(range(1, steps + 1)) and "actor/pg_loss" in record
    assert all(math.isfinite(r["critic/advantages_mean"]) and r["rollout/nonfinite_dropped"] == 0 for r in records)
    assert ("critic/vf_loss" in record) == expect_critic
    assert "actor/kl_loss" not in record and "actor/reward_kl_penalty" not in record  # no KL term in these configs
    tags = [t for t in ("FrozenLakeDescribed", "FrozenLakeNoDeadEnds", "GuessNumber") if f"env/{t}/num_actions" in record]
    assert tags == (["GuessNumber"] if any("GuessNumber" in e for e in extra) else [env_tag])


@pytest.mark.e2e
@pytest.mark.shared_cluster
@pytest.mark.parametrize(
    "config_name, extra, expect_critic",
    [
        # PPO with the critic in a group of its own (one rank on both cores, bf16 autocast) instead of the actor's
        # ranks, on the example environment of docs/writing_an_environment.md (registered by config only)
        ("frozenlake", ["critic.colocate=false", "critic.fsdp.num_threads=2", "critic.fsdp.mixed_precision=bf16",
                        "es_manager.train.env_configs.tags=[GuessNumber]"], True),
        # multi-turn GRPO on condensed per-turn rows, with StarPO-S filtering (1 of 2 groups kept) and
        # mean_std reward normalisation: a varying row count padded to whole mini-batches on 2 FSDP ranks
        ("frozenlake_grpo_multiturn", ["actor_rollout_ref.rollout.rollout_filter_value=0.5",
                                       "agent_proxy.reward_normalization.method=mean_std"], False),
        # GiGPO (anchor states hashed by the rollout) and ReMax (a greedy baseline episode per group),
        # two steps each by config only
        ("frozenlake_gigpo", ["trainer.total_training_steps=2"], False),
        ("frozenlake_remax", ["trainer.total_training_steps=2"], False),
        # make train's RL config (GiGPO, 8 episodes per map, on the maps without dead ends, think-then-answer);
        # its micro-batch of 8 is cut to fit TINY's mini-batch of 8 over 2 ranks
        ("frozenlake_nodeadends", ["trainer.total_training_steps=2", "micro_batch_size_per_gpu=4"], False),
    ],
)
def test_config_trains(tiny_model_path, tmp_path, config_name, extra, expect_critic):
    """The shipped configs with the command line's overrides, trained in this process on the e2e tests' shared cluster
    (bi-level GAE with the GSPO loss: test_rewards_e2e's align-anything config file)."""
    train_here(config_name, tiny_model_path, tmp_path / "run", *TINY, *extra)
    records = metrics_records(tmp_path / "run")
    check_records(records, extra, expect_critic,
                  "FrozenLakeNoDeadEnds" if config_name == "frozenlake_nodeadends" else "FrozenLakeDescribed")
    record = records[-1]
    if config_name == "frozenlake_grpo_multiturn":
        assert record["rollout/filter_kept_ratio"] == 0.5
        rows, padding = record["perf/num_rows"], record["perf/update_actor_padding_rows"]
        assert 4 <= rows <= 8 and (rows + padding) % 8 == 0  # 1 group x 4 episodes x 1..2 turns, padded
    if config_name == "frozenlake_remax":
        for r in records:  # the greedy baseline ran in its own phase and was not trained on
            assert r["timing_s/remax_baseline"] > 0 and math.isfinite(r["rollout/remax_baseline_reward_mean"])
            assert r["perf/num_rows"] == 8  # 2 groups x 4 sampled episodes


def test_bad_config_names_the_key(tiny_model_path, tmp_path):
    cmd = [sys.executable, "-m", "agent_trainer.main", "--config-name", "frozenlake",
           f"model_path={tiny_model_path}", "ppo_mini_batch_size=7"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "ppo_mini_batch_size (7)" in proc.stderr and "Traceback" not in proc.stderr
