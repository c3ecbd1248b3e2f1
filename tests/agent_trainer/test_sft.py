"""SFT without Ray: config refusals (one line, before ray.init), data splits, length buckets, collation."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from agent_trainer.agents.demonstrations import reply_text
from agent_trainer.sft import SFTRow, collate, compose_sft, length_batches, split_held_out
from agent_trainer.config.docs import DOCS_PAGE, render_docs

REPO = Path(__file__).resolve().parents[2]


def _compose(model, *overrides):
    return compose_sft("sft_frozenlake", [f"model_path={model}", "data.num_episodes=20", *overrides])


def test_the_frozenlake_config_plays_demonstrations_in_the_rl_format(tiny_model_path):
    run = _compose(tiny_model_path)
    assert run.rl.es_manager.train.tags == ["FrozenLakeDescribed"] and run.rl.agent_proxy.max_turn == 6
    assert run.rl.actor_rollout_ref.rollout.val_kwargs.temperature == 0.0  # greedy held-out episodes
    assert run.rl.actor_rollout_ref.model.path == tiny_model_path
    assert (len(run.data.train), len(run.data.val)) == (18, 2)
    seeds = {d.seed for part in run.data.demos.values() for d in part}
    assert seeds == set(range(20))
    for demo, row in zip(run.data.demos["train"], run.data.train):
        assert row.token_ids == demo.token_ids and row.response_mask == demo.response_mask


def test_make_trains_warm_start_is_a_noting_walker_on_the_maps_without_dead_ends(tiny_model_path):
    """config/sft_frozenlake_nodeadends.yaml: the RL config's tag, think-then-answer replies whose think notes the
    Down and Right tiles, moves only Down or Right, all of them the walker's (no noise)."""
    run = compose_sft("sft_frozenlake_nodeadends", [f"model_path={tiny_model_path}", "data.num_episodes=40"])
    assert run.rl.es_manager.train.tags == ["FrozenLakeNoDeadEnds"] == run.rl.es_manager.val.tags
    assert run.rl.algorithm.adv_estimator == "gigpo" and run.rl.agent_proxy.enable_think
    demos = run.data.demos["train"] + run.data.demos["val"]
    assert {d.tag for d in demos} == {"FrozenLakeNoDeadEnds"}
    actions = [a for d in demos for a in d.actions]
    assert set(actions) == {"Down", "Right"} and all(e for d in demos for e in d.expert)
    replies = [m["content"] for d in demos for m in d.messages if m["role"] == "assistant"]
    assert all(r.startswith("<think>Down: ") and ", Right: " in r for r in replies)


@pytest.mark.parametrize("override, expected", [
    ("data.noise=1.5", "data.noise = 1.5 must lie in [0, 1]; e.g. data.noise=0.1"),
    ("data.nois=0.1", "data.nois is not a config key (got data.nois=0.1); did you mean data.noise?"),
    ("train.batch_size=15", "train.batch_size = 15 must be a multiple of the RL config's "
                            "actor_rollout_ref.actor.fsdp.world_size = 2"),
    ("data.source=jsonl", "data.train_files = [] but data.source = 'jsonl'"),
    ("data.source=jsonl data.train_files=[t.jsonl] data.noise=0 data.demonstrator=envs.frozen_lake:noting_walker",
     "data.demonstrator = 'envs.frozen_lake:noting_walker' apply to data.source=demonstrations only"),
    ("data.source=web", "data.source = 'web' is not one of ['demonstrations', 'jsonl']"),
    ("data.think=notes", "data.think = 'notes' is not one of ['plain', 'note']"),
    ("data.source=jsonl data.train_files=[t.jsonl] data.noise=0 data.think=note",
     "data.think = 'note' apply to data.source=demonstrations only"),
    ("rl_config=nope", "rl_config = 'nope' with rl_overrides []: Cannot find primary config 'nope'"),
    ('rl_overrides=["agent_proxy.max_turn=0"]', "agent_proxy.max_turn = 0 must be >= 1"),
    ('rl_overrides=["model_path=x"]', "rl_overrides sets model_path, which the SFT run sets itself"),
    ('rl_overrides=["trainer.seed=3"]', "rl_overrides sets trainer.seed, which the SFT run sets itself"),
    ('rl_overrides=["ctx_manager.mode=condensed","algorithm.adv_estimator=grpo_multiturn"]',
     "ctx_manager.mode = 'condensed' in rl_config 'frozenlake'"),
    ("data.seed=1073741820", "reaches the RL validation seeds [1073741824, 1073741952)"),
    ("data.tags=[Countdown]", "data.noise = 0.3 needs a list of valid actions"),
    ('rl_overrides=["es_manager.train.env_configs.tags=[Bandit]"]', None),
    ("data.noise=0 data.noise_actions=[Down,Right]", "data.noise_actions = ['Down', 'Right'] is what noisy turns draw from, "
                                        "but data.noise = 0 makes none"),
    ("train.optim.min_lr_ratio=0.2", "train.optim.min_lr_ratio = 0.2 is the floor of the cosine schedule"),
    ("train.optim.lr_scheduler_type=step", "train.optim.lr_scheduler_type = 'step' is not one of"),
    ("trainer.merge_lora=true", "trainer.merge_lora = True merges a LoRA adapter, but the RL config's "
                                "actor_rollout_ref.model.lora_rank = 0 trains the full model"),
    ("data.demonstrator=envs.frozen_lake:nothing", "data.demonstrator = 'envs.frozen_lake:nothing' could not be "
                                                   "imported"),
])
def test_mistakes_are_refused_in_one_line(tiny_model_path, override, expected):
    overrides = override.split(" ") + (["data.noise=0.3"] if "Countdown" in override else [])
    if expected is None:  # Bandit has an expert: a warm start for it is allowed
        assert _compose(tiny_model_path, *overrides).data.demos["train"][0].tag == "Bandit"
        return
    with pytest.raises(SystemExit) as exc:
        _compose(tiny_model_path, *overrides)
    message = str(exc.value)
    assert message.startswith("agent-trainer sft: ") and "\n" not in message
    assert expected in message, message


def test_jsonl_data_and_a_too_long_conversation(tiny_model_path, tmp_path):
    conv = {"messages": [{"role": "user", "content": "Go?"}, {"role": "assistant", "content": reply_text("Down")}]}
    train = tmp_path / "train.jsonl"
    train.write_text("\n".join(json.dumps(conv) for _ in range(10)) + "\n")
    run = _compose(tiny_model_path, "data.source=jsonl", "data.noise=0", f"data.train_files=[{train}]",
                   "data.val_fraction=0.3")
    assert (len(run.data.train), len(run.data.val)) == (7, 3) and not run.data.demos
    long = {"messages": [{"role": "user", "content": "word " * 3000}, conv["messages"][1]]}
    train.write_text(json.dumps(conv) + "\n" + json.dumps(long) + "\n")
    with pytest.raises(SystemExit, match=r"train.jsonl: conversation 2 has \d+ tokens, more than"):
        _compose(tiny_model_path, "data.source=jsonl", "data.noise=0", f"data.train_files=[{train}]")


def test_held_out_split_is_disjoint_seeded_and_never_empty():
    items = list(range(50))
    train, val = split_held_out(items, 0.1, seed=3)
    assert len(val) == 5 and sorted(train + val) == items
    assert split_held_out(items, 0.1, seed=3) == (train, val) and split_held_out(items, 0.1, seed=4) != (train, val)
    assert [len(p) for p in split_held_out([1, 2], 0.01, 0)] == [1, 1]
    with pytest.raises(ValueError, match="need at least 2"):
        split_held_out([1], 0.5, 0)


def test_length_buckets_cover_every_row_once_and_cut_padding():
    rng = random.Random(0)
    rows = [SFTRow([1] * n, [0] * n) for n in (rng.randint(50, 500) for _ in range(200))]

    def padding(batches):
        return sum(len(b) * max(len(rows[i].token_ids) for i in b) - sum(len(rows[i].token_ids) for i in b)
                   for b in batches)

    bucketed = length_batches(rows, 16, random.Random(1), group_by_length=True)
    plain = length_batches(rows, 16, random.Random(1), group_by_length=False)
    for batches in (bucketed, plain):
        assert sorted(i for b in batches for i in b) == list(range(200))
        assert all(len(b) <= 16 for b in batches)
    assert padding(bucketed) < 0.2 * padding(plain)
    assert length_batches(rows, 16, random.Random(2), True) != bucketed  # a new order every epoch


def test_collate_right_pads_with_masks_and_positions():
    batch = collate([SFTRow([5, 6, 7], [0, 1, 1]), SFTRow([8], [0])], pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["response_mask"].tolist() == [[0, 1, 1], [0, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 0, 0]]


def test_docs_config_table_is_current():
    page = (REPO / DOCS_PAGE).read_text()
    assert render_docs(page) == page, "run: .venv/bin/python -m launch.config_docs"


def test_the_summary_of_a_lora_sft_gives_the_rl_command_with_the_adapter(tmp_path):
    """A LoRA SFT's final/ is an adapter folder: the RL command keeps the base as model_path."""
    from agent_trainer.config import ModelConfig
    from agent_trainer.sft import summary

    history = [{"val/sft_loss": 2.0}, {"val/sft_loss": 1.0, "sft/epoch": 1.0}]
    lora = ModelConfig(path="models/tiny-qwen2", lora_rank=8, lora_alpha=16.0, target_modules=["q_proj", "v_proj"])
    text = summary(history, tmp_path, lora)
    assert (f"model_path=models/tiny-qwen2 actor_rollout_ref.model.lora_rank=8 actor_rollout_ref.model.lora_alpha=16.0 "
            f"'actor_rollout_ref.model.target_modules=[q_proj,v_proj]' "
            f"actor_rollout_ref.model.lora_adapter_path={tmp_path / 'final'}") in text
    assert f"model_path={tmp_path / 'final'}" in summary(history, tmp_path, ModelConfig(path="models/tiny-qwen2"))
