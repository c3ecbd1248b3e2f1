"""The reward-model path without Ray: text selection, padding, scores on the right token, the worker's forward."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from agent_trainer.training import reward_model
from agent_trainer.common.batch import TensorBatch
from agent_trainer.config.rewards import RewardModelConfig, RewardModelModelConfig
from launch.build_tiny_model import build_reward_model
from agent_trainer.workers.reward_model import RewardModelWorker


@pytest.fixture(scope="module")
def rm_path(tiny_model_path, tmp_path_factory) -> str:
    return str(build_reward_model(tiny_model_path, tmp_path_factory.mktemp("rm") / "rm"))


def rollout_batch(tokenizer) -> TensorBatch:
    """Two full-mode episodes (prompt | reply 1 | obs | reply 2 | pad) and a condensed episode of two rows."""
    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    layout = [  # (segments of (text, generated)), traj_uid
        ([("<|im_start|>user\nGo<|im_end|>\n<|im_start|>assistant\n", 0), ("Left<|im_end|>", 1),
          ("\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n", 0), ("Right now<|im_end|>", 1)], 0),
        ([("<|im_start|>user\nGo<|im_end|>\n<|im_start|>assistant\n", 0), ("Down<|im_end|>", 1)], 1),
        ([("<|im_start|>user\nturn 1<|im_end|>\n<|im_start|>assistant\n", 0), ("Up<|im_end|>", 1)], 2),
        ([("<|im_start|>user\nturn 2<|im_end|>\n<|im_start|>assistant\n", 0), ("Up again<|im_end|>", 1)], 2),
    ]
    rows = [[(i, g) for text, g in segs for i in enc(text)] for segs, _ in layout]
    width = max(len(r) for r in rows) + 3
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    mask, attn = torch.zeros_like(ids), torch.zeros_like(ids)
    for b, row in enumerate(rows):
        ids[b, :len(row)] = torch.tensor([i for i, _ in row])
        mask[b, :len(row)] = torch.tensor([g for _, g in row])
        attn[b, :len(row)] = 1
    return TensorBatch({"input_ids": ids, "response_mask": mask, "attention_mask": attn,
                        "token_level_rewards": torch.zeros(ids.shape), "traj_uid": torch.tensor([u for _, u in layout])})


def test_texts_scores_and_their_place(tiny_model_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    batch = rollout_batch(tokenizer)
    rows = reward_model.last_rows(batch)
    assert rows == [0, 1, 3]  # the condensed episode is scored on its last turn's row
    assert reward_model.episode_texts(batch, rows, tokenizer, "response") == ["Right now", "Down", "Up again"]
    conversation = reward_model.episode_texts(batch, rows, tokenizer, "conversation")
    assert conversation[0].startswith("<|im_start|>user\nGo") and conversation[0].endswith("Right now<|im_end|>")
    reward_model.add_scores(batch, rows, torch.tensor([1.0, -2.0, 3.0]), weight=0.5)
    rewards = batch["token_level_rewards"]
    for row, value in zip(rows, [0.5, -1.0, 1.5]):
        last = int(batch["response_mask"][row].nonzero()[-1])
        assert rewards[row, last] == value and rewards[row].sum() == value
    assert rewards[2].sum() == 0
    metrics = reward_model.score_metrics(batch, rows, torch.tensor([1.0, -2.0, 3.0]))
    assert metrics["reward_model/score_mean"] == pytest.approx(2 / 3)
    assert metrics["reward_model/episode_reward_mean"] == pytest.approx(1.0 / 3)


def test_worker_scores_equal_a_direct_forward_pass(rm_path):
    cfg = RewardModelConfig(enable=True, model=RewardModelModelConfig(path=rm_path), micro_batch_size_per_gpu=2)
    worker = RewardModelWorker(rank=0, world_size=1, reward_model=cfg, device="cpu")
    worker.init_model()
    tokenizer = AutoTokenizer.from_pretrained(rm_path)
    texts = ["What is 2 + 3? 5", "a", "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nLeft<|im_end|>"]
    scores = worker.compute_rm_score(reward_model.encode_texts(tokenizer, texts, max_length=64))["rm_scores"]
    direct = AutoModelForSequenceClassification.from_pretrained(rm_path).eval()
    with torch.no_grad():
        expected = [direct(**tokenizer(t, return_tensors="pt")).logits[0, 0].item() for t in texts]
    assert scores.tolist() == pytest.approx(expected, abs=1e-5)
    assert len(set(scores.tolist())) == 3
    long = reward_model.encode_texts(tokenizer, ["word " * 100], max_length=8)
    assert long["input_ids"].shape == (1, 8)  # the last max_length tokens


def test_a_model_with_two_labels_is_refused(tiny_model_path):
    from agent_trainer.workers.reward_model import load_reward_model

    with pytest.raises(ValueError, match="num_labels = 2"):
        load_reward_model(tiny_model_path)
