"""Reward sources end to end (real Ray, FSDP2, vLLM): each run's logged rewards come from the source it claims.

- single-turn GRPO over the shipped arithmetic JSONL, scored by a custom reward function;
  the function records every call, and the logged episode rewards are exactly its scores;
- single-turn PPO over prompts without ground truth, scored by the tiny reward model alone;
- FrozenLake with environment rewards plus the reward model's score of the whole conversation,
  validated after the last step: the validation episodes are scored by the reward model too;
- FrozenLake from a config file written with align-anything's keys (config/seed_style_frozenlake.yaml), on
  the command line (the others run in this process, on one cluster).
The reward-model runs dump every scored text: each score equals a direct forward pass of the
reward model on that text, and the logged rewards add up to env reward + weight x score.
"""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from e2e_runs import metrics_records, train_here

REPO = Path(__file__).resolve().parents[2]
TINY = ["trainer.test_freq=0", "ppo_mini_batch_size=8", "es_manager.train.env_groups=2",
        "es_manager.train.env_configs.n_groups=[2]", "actor_rollout_ref.rollout.response_length=16"]
ONE_ACTOR_RANK = ["actor_rollout_ref.actor.fsdp.world_size=1"]  # the reward-model runs add two FSDP groups


def run_cli(config_name: str, run_dir: Path, tiny_model_path: str, extra: list[str], tiny: list[str] = TINY,
            console: list[str] | None = None) -> list[dict]:
    """One command-line run; returns its metrics records (and appends its stdout and stderr lines to ``console``)."""
    cmd = [sys.executable, "-m", "agent_trainer.main", "--config-name", config_name, f"model_path={tiny_model_path}",
           f"trainer.default_local_dir={run_dir}", *tiny, *extra]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if console is not None:  # hydra's log handler writes to stdout, the one-line refusals to stderr
        console.extend(proc.stdout.splitlines() + proc.stderr.splitlines())
    return metrics_records(run_dir)


def run_here(config_name: str, run_dir: Path, tiny_model_path: str, extra: list[str], tiny: list[str] = TINY,
             ) -> list[dict]:
    """The same run in this process, on the e2e tests' shared cluster; returns its metrics file's records."""
    train_here(config_name, tiny_model_path, run_dir, *tiny, *extra)
    return metrics_records(run_dir)


RECORDING_FN = '''
import json
import os
from pathlib import Path
import importlib.util

spec = importlib.util.spec_from_file_location("arith_reward", {reward!r})
arith = importlib.util.module_from_spec(spec)
spec.loader.exec_module(arith)


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    score = arith.compute_score(data_source, solution_str, ground_truth, extra_info)
    with open(Path(__file__).with_suffix(".calls.jsonl"), "a") as f:
        f.write(json.dumps({{"data_source": data_source, "solution": solution_str, "truth": ground_truth,
                            "score": score, "pid": os.getpid()}}) + "\\n")
    return score
'''


@pytest.mark.e2e
@pytest.mark.shared_cluster
def test_single_turn_grpo_with_custom_reward_function(tiny_model_path, tmp_path):
    """2 GRPO steps over data/arith/train.jsonl; the episode rewards logged are the function's scores."""
    fn_file = tmp_path / "recording_reward.py"
    fn_file.write_text(RECORDING_FN.format(reward=str(REPO / "data/arith/reward.py")))
    records = run_here("arith_grpo", tmp_path / "run", tiny_model_path, [
        "trainer.total_training_steps=2", f"reward.custom_reward_function.path={fn_file}",
        "es_manager.format_penalty=0.0"])
    assert [r["step"] for r in records] == [1, 2]
    assert all(math.isfinite(r["actor/pg_loss"]) and "env/PromptData/num_actions" in r for r in records)
    recorded = [json.loads(line) for line in fn_file.with_suffix(".calls.jsonl").read_text().splitlines()]
    # the env preflight plays each split's env in this process (the driver) before the workers start: its calls
    # score the expert's and junk answers, the env actors' calls score the policy's
    preflight = [c for c in recorded if c["pid"] == os.getpid()]
    calls = [c for c in recorded if c["pid"] != os.getpid()]
    assert preflight and max(c["score"] for c in preflight) > 0, "the preflight did not score the expert's answer"
    assert calls, "the policy never answered, so the reward function was never called"
    sys.path.insert(0, str(REPO / "data/arith"))
    from reward import compute_score  # the shipped example the recording function wraps

    train_rows = [json.loads(line) for line in (REPO / "data/arith/train.jsonl").read_text().splitlines()]
    truths = {row["reward_model"]["ground_truth"] for row in train_rows}
    for call in calls:  # every call scored a training row's answer with the shipped function
        assert call["data_source"] == "arith" and call["truth"] in truths
        assert call["score"] == compute_score("arith", call["solution"], call["truth"])
    # 2 groups x 4 episodes per step, no format penalty: the logged rewards sum to the function's scores
    logged_total = sum(r["rollout/episode_reward_mean"] * 8 for r in records)
    assert logged_total == pytest.approx(sum(c["score"] for c in calls), abs=1e-6)


@pytest.fixture(scope="module")
def tiny_rm_path(tiny_model_path, tmp_path_factory) -> str:
    """The tiny reward model (the policy's backbone + a seeded score head), as `make model` builds it."""
    from launch.build_tiny_model import build_reward_model

    return str(build_reward_model(tiny_model_path, tmp_path_factory.mktemp("rm") / "tiny-qwen2-rm"))


def dumped_scores(path: Path, rm_path: str) -> list[dict]:
    """The scores a run dumped, each checked against a direct HF forward pass of the reward model on its text."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    dumped = [json.loads(line) for line in path.read_text().splitlines()]
    model = AutoModelForSequenceClassification.from_pretrained(rm_path).eval()
    tokenizer = AutoTokenizer.from_pretrained(rm_path)
    with torch.no_grad():
        for d in dumped:
            direct = model(**tokenizer(d["text"], return_tensors="pt")).logits[0, 0].item()
            assert d["score"] == pytest.approx(direct, abs=1e-4), d["text"]
    return dumped


def check_reward_model_rewards(run_dir: Path, records: list[dict], rm_path: str, weight: float) -> list[dict]:
    """Dumped scores = a direct HF forward pass; logged rewards = env reward + weight x score, per step."""
    dumped = dumped_scores(run_dir / "reward_model_scores.jsonl", rm_path)
    for r in records:
        scores = [d["score"] for d in dumped if d["step"] == r["step"]]
        assert len(scores) == 8  # 2 groups x 4 episodes, one score each
        assert r["reward_model/score_mean"] == pytest.approx(sum(scores) / 8, abs=1e-5)
        assert r["reward_model/episode_reward_mean"] == pytest.approx(
            r["rollout/episode_reward_mean"] + weight * sum(scores) / 8, abs=1e-5)
        assert r["timing_s/reward_model"] > 0
    assert len({d["score"] for d in dumped}) > 1  # the scores depend on the text
    return dumped


@pytest.mark.e2e
@pytest.mark.shared_cluster
def test_single_turn_ppo_with_the_tiny_reward_model(tiny_model_path, tiny_rm_path, tmp_path):
    """2 PPO steps over TXT prompts (no ground truth): every reward is the reward model's score of the reply."""
    run_dir = tmp_path / "run"
    records = run_here("arith_ppo_rm", run_dir, tiny_model_path, [
        "trainer.total_training_steps=2", *ONE_ACTOR_RANK, f"reward_model.model.path={tiny_rm_path}",
        "reward_model.dump_scores=true", "es_manager.format_penalty=0.0"])
    assert [r["step"] for r in records] == [1, 2] and all("critic/vf_loss" in r for r in records)
    assert all(r["rollout/episode_reward_mean"] == 0.0 for r in records)  # no ground truth: the env pays nothing
    dumped = check_reward_model_rewards(run_dir, records, tiny_rm_path, weight=1.0)
    assert not any("<|im_start|>" in d["text"] for d in dumped)  # input=response: the reply alone


@pytest.mark.e2e
@pytest.mark.shared_cluster
def test_frozenlake_with_env_and_reward_model_rewards(tiny_model_path, tiny_rm_path, tmp_path):
    """2 steps of FrozenLake PPO; each episode's reward is its env rewards + 0.5 x the RM's conversation score.

    Validated after step 2 on 2 episodes: the validation episodes get the reward model's scores too.
    """
    run_dir = tmp_path / "run"
    validate = [o for o in TINY if not o.startswith("trainer.test_freq=")] + [
        "trainer.test_freq=2", "trainer.val_before_train=false", "es_manager.val.env_groups=2",
        "es_manager.val.env_configs.n_groups=[2]"]
    records = run_here("frozenlake_rm", run_dir, tiny_model_path, [
        "trainer.total_training_steps=2", *ONE_ACTOR_RANK, f"reward_model.model.path={tiny_rm_path}",
        "reward_model.dump_scores=true", "agent_proxy.max_turn=2"], tiny=validate)
    assert [r["step"] for r in records] == [1, 2]
    assert all(any(re.fullmatch(r"env/FrozenLake\w*/num_actions", k) for k in r) for r in records)  # the config's tag
    dumped = check_reward_model_rewards(run_dir, records, tiny_rm_path, weight=0.5)
    assert all(d["text"].count("<|im_start|>user") >= 1 for d in dumped)  # input=conversation: the whole episode
    val = dumped_scores(run_dir / "reward_model_scores_val.jsonl", tiny_rm_path)
    assert [d["step"] for d in val] == [2, 2]  # the 2 validation episodes, scored once, after the last step
    assert records[1]["val/reward_model/score_mean"] == pytest.approx(sum(d["score"] for d in val) / 2, abs=1e-5)
    assert records[1]["val/reward_model/episode_reward_mean"] == pytest.approx(
        records[1]["val/episode_reward_mean"] + 0.5 * sum(d["score"] for d in val) / 2, abs=1e-5)
    assert "val/reward_model/score_mean" not in records[0]


@pytest.mark.e2e
def test_a_config_file_with_align_anything_keys_trains(tiny_model_path, tmp_path):
    """config/seed_style_frozenlake.yaml (train_cfgs / model_cfgs sections) composes, logs one notice per key,
    and trains 2 steps with the mapped values: bi-level GAE with a critic, 4 turns; the command line wins
    (and adds the GSPO sequence-level loss, and the adaptive KL-in-reward against a reference in a group of
    its own, the policy and the reference in bf16 autocast)."""
    import yaml

    run_dir, console = tmp_path / "run", []
    records = run_cli("seed_style_frozenlake", run_dir, tiny_model_path, [
        "trainer.total_training_steps=2", "algorithm.high_level_gamma=0.9",
        "actor_rollout_ref.actor.policy_loss_mode=gspo", "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.type=adaptive", "actor_rollout_ref.ref.colocate=false",
        "actor_rollout_ref.actor.fsdp.mixed_precision=bf16", "actor_rollout_ref.ref.fsdp.mixed_precision=bf16"],
        console=console)
    notices = [line[line.index(m.group(1)):] for line in console
               if (m := re.search(r"\b((?:train|model)_cfgs\.\w+ is align-anything's name)", line))]
    assert notices == [
        "train_cfgs.multi_turn is align-anything's name; train_cfgs.multi_turn=true needs nothing set here (true: "
        "nothing to set (every run is multi-turn; agent_proxy.max_turn sets the turns); false: agent_proxy.max_turn=1)",
        "train_cfgs.bi_level_gae is align-anything's name; using algorithm.bi_level_gae=true",
        "train_cfgs.high_level_gamma is align-anything's name; using algorithm.high_level_gamma=0.95 (the command "
        "line's algorithm.high_level_gamma wins)",
        "train_cfgs.gamma is align-anything's name; using algorithm.gamma=1.0",
        "train_cfgs.gae_lambda is align-anything's name; using algorithm.lam=1.0",
        "train_cfgs.max_turn is align-anything's name; using agent_proxy.max_turn=4",
        "model_cfgs.use_reward_model is align-anything's name; using reward_model.enable=false",
        "model_cfgs.use_reward_critic is align-anything's name; using critic.enable=true",
    ], console[:20]
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["algorithm"]["adv_estimator"] == "bi_level_gae" and saved["algorithm"]["high_level_gamma"] == 0.9
    assert saved["agent_proxy"]["max_turn"] == 4 and saved["critic"]["enable"] is True
    assert saved["actor_rollout_ref"]["actor"]["policy_loss_mode"] == "gspo"
    assert saved["actor_rollout_ref"]["ref"]["colocate"] is False
    assert saved["algorithm"]["kl_ctrl"]["type"] == "adaptive"
    assert saved["train_cfgs"] == {} and saved["model_cfgs"] == {}
    assert [r["step"] for r in records] == [1, 2]
    assert all("critic/vf_loss" in r and r["rollout/num_turns_mean"] <= 4 for r in records)
    assert all(math.isfinite(r["actor/reward_kl_penalty"]) and r["timing_s/ref"] > 0 for r in records)
    assert all("actor/kl_loss" not in r and r["rollout/nonfinite_dropped"] == 0 for r in records)
