"""Condensed context (one row per turn) over real FrozenLake / Bandit episodes and the tiny tokenizer."""

import pytest
import torch

from agent_trainer import core_algos
from agent_trainer.agents.condensed_ctx import NO_ANSWER, CondensedContextManager
from agent_trainer.config.multiturn import ContextCondenserConfig
from agent_trainer.agents.ctx_manager import ContextManager, anchor_id


def _rows_in_order(played):
    """(env_id, turn index) of every expected row: episodes in env order, turns in order."""
    return [(env_id, k) for env_id in sorted(played.episodes) for k in range(len(played.generated[env_id]))]


def test_one_row_per_turn_holds_the_prompt_and_the_generated_ids_verbatim(tokenizer, play_mixed):
    ctx_mgr = CondensedContextManager(tokenizer, keep_last_n_turns=2, max_model_len=4096)
    played = play_mixed(ctx_mgr)
    batch = ctx_mgr.build_update_batch([played.episodes[k] for k in sorted(played.episodes)])
    rows = _rows_in_order(played)
    turns = {env_id: len(g) for env_id, g in played.generated.items()}
    assert turns[2] == 1 and turns[1] == 4  # episodes end at different turns
    assert len(batch) == len(rows) == sum(turns.values())

    groups = {0: 0, 1: 0, 2: 1, 3: 1}
    for row, (env_id, k) in enumerate(rows):
        prompt, reply = played.prompts[env_id][k], played.generated[env_id][k]
        n = len(prompt) + len(reply)
        # c_k is exactly the prompt the reply was generated from; o_k is the engine's ids verbatim
        assert batch["input_ids"][row, :n].tolist() == prompt + reply
        assert batch["response_mask"][row].tolist() == [0] * len(prompt) + [1] * len(reply) + [0] * (
            batch["input_ids"].shape[1] - n)
        assert batch["attention_mask"][row].sum() == n
        assert torch.allclose(batch["rollout_log_probs"][row, len(prompt):n], torch.tensor(played.logprobs[env_id][k]))
        assert batch["rollout_log_probs"][row, : len(prompt)].abs().sum() == 0
        assert batch["turn_ids"][row, len(prompt):n].tolist() == [k + 1] * len(reply)
        assert batch["turn_ids"][row, : len(prompt)].abs().sum() == 0
        assert batch["traj_uid"][row] == env_id and batch["uid"][row] == groups[env_id]
    tag_of_row = {env_id: int(batch["tag_ids"][row]) for row, (env_id, _) in enumerate(rows)}
    assert tag_of_row[0] == tag_of_row[1] != tag_of_row[2] == tag_of_row[3]


def test_each_turn_reward_sits_on_its_row_and_episodes_sum_to_their_total(tokenizer, play_mixed):
    ctx_mgr = CondensedContextManager(tokenizer, max_model_len=4096)
    played = play_mixed(ctx_mgr)
    batch = ctx_mgr.build_update_batch([played.episodes[k] for k in sorted(played.episodes)])
    rows = _rows_in_order(played)
    rewards = batch["token_level_rewards"]
    for row, (env_id, k) in enumerate(rows):
        last = len(played.prompts[env_id][k]) + len(played.generated[env_id][k]) - 1
        assert rewards[row, last].item() == pytest.approx(played.outputs[env_id][k].reward)
        assert rewards[row].nonzero().flatten().tolist() in ([], [last])
    totals = {env_id: sum(o.reward for o in outs) for env_id, outs in played.outputs.items()}
    assert totals[1] == pytest.approx(-0.4)  # four format penalties, one per turn
    for env_id, total in totals.items():
        in_episode = batch["traj_uid"] == env_id
        assert rewards[in_episode].sum().item() == pytest.approx(total)
        assert played.episodes[env_id].total_reward == pytest.approx(total)

    # grpo_multiturn reads the rows as trajectories: every generated token of episode j gets
    # A_j = GRPO of the episode totals within its group (unbiased std, groups of two)
    adv, _ = core_algos.compute_advantage(batch.tensors, "grpo_multiturn")
    for members in ([0, 1], [2, 3]):
        scores = torch.tensor([totals[e] for e in members], dtype=torch.float64)
        expected = (scores - scores.mean()) / (scores.std() + 1e-6)
        for env_id, a in zip(members, expected):
            rows_j = batch["traj_uid"] == env_id
            mask = batch["response_mask"][rows_j].bool()
            assert torch.allclose(adv[rows_j][mask], torch.full((int(mask.sum()),), float(a)), atol=1e-5)
            assert adv[rows_j][~mask].abs().sum() == 0


def test_each_prompt_is_rebuilt_from_the_last_n_turns(tokenizer, play_mixed):
    ctx_mgr = CondensedContextManager(tokenizer, keep_last_n_turns=1, max_model_len=4096)
    played = play_mixed(ctx_mgr)
    first, second, fourth = (tokenizer.decode(played.prompts[0][k]) for k in (0, 1, 3))
    assert first.startswith("<|im_start|>system\n") and first.endswith("<|im_start|>assistant\n")
    assert "Recent turns" not in first and "Current observation (turn 1)" in first
    # turn 2 remembers turn 1's answer and reward as text, not its reasoning or its tokens
    assert "Turn 1:" in second and "Your answer: Left" in second and "try it" not in second
    assert f"Reward: {played.outputs[0][0].reward:g}" in second
    # keep_last_n_turns=1: turn 4 shows turn 3 only, and turn 2's garbage reply as "no answer" is gone
    assert "Turn 3:" in fourth and "Turn 2:" not in fourth and "Current observation (turn 4)" in fourth
    assert NO_ANSWER in tokenizer.decode(played.prompts[1][1])

    no_history = CondensedContextManager(tokenizer, keep_last_n_turns=0, max_model_len=4096)
    played = play_mixed(no_history)
    assert all("Recent turns" not in tokenizer.decode(p) for p in played.prompts[1])


def test_rows_stay_short_while_a_full_sequence_grows(tokenizer, play_mixed):
    condensed = CondensedContextManager(tokenizer, keep_last_n_turns=1, max_model_len=4096)
    played = play_mixed(condensed, max_turn=6)
    prompt_lens = [len(p) for p in played.prompts[1]]  # env 1 plays all six turns
    assert len(prompt_lens) == 6 and max(prompt_lens[1:]) - min(prompt_lens[1:]) <= 2  # bounded, not growing
    full = ContextManager(tokenizer, max_model_len=4096)
    full_played = play_mixed(full, max_turn=6)
    assert played.episodes[1].longest_row < full_played.episodes[1].longest_row


def test_an_episode_ends_when_the_next_prompt_would_not_fit(tokenizer, play_mixed):
    ctx_mgr = CondensedContextManager(tokenizer, max_model_len=4096)
    first_prompt = len(play_mixed(ctx_mgr, max_turn=1).prompts[1][0])
    # a budget larger than the model leaves room for: turn 2's recap is kept whole and overflows
    roomy = ContextCondenserConfig(keep_last_n_steps=2, max_condensed_tokens=4096)
    tight = CondensedContextManager(tokenizer, condenser=roomy, max_model_len=first_prompt + 40)
    played = play_mixed(tight)
    ep = played.episodes[1]
    assert ep.done and ep.truncated and ep.num_turns == 1
    assert all(len(p) + 32 <= first_prompt + 40 for p in played.prompts[1])


def test_a_budget_that_leaves_room_for_the_reply_drops_old_turns_instead_of_ending(tokenizer, play_mixed):
    first_prompt = len(play_mixed(CondensedContextManager(tokenizer, max_model_len=4096), max_turn=1).prompts[1][0])
    budget = ContextCondenserConfig(keep_last_n_steps=2, max_condensed_tokens=first_prompt + 8)
    ctx_mgr = CondensedContextManager(tokenizer, condenser=budget, max_model_len=first_prompt + 40)
    played = play_mixed(ctx_mgr)
    ep = played.episodes[1]
    assert not ep.context_overflow and ep.num_turns == 4
    assert all(len(p) <= first_prompt + 8 for p in played.prompts[1])
    # what the full conversation would hold grows every turn, while the condensed prompt stays flat
    before = [r.uncondensed_tokens for r in ep.rows]
    assert before == sorted(before) and len(set(before)) == 4 and before[-1] > len(ep.rows[-1].prompt_ids)


def test_each_row_carries_the_anchor_of_the_observation_its_turn_answered(tokenizer, play_mixed, mixed_manager):
    ctx_mgr = CondensedContextManager(tokenizer, max_model_len=4096)
    played = play_mixed(ctx_mgr)
    batch = ctx_mgr.build_update_batch([played.episodes[k] for k in sorted(played.episodes)])
    history = {s.env_id: s.history for s in mixed_manager.get_rollout_states()}
    expected = [anchor_id(history[env_id][k].observation) for env_id, k in _rows_in_order(played)]
    assert batch["anchor_obs_ids"].shape == (len(batch),)  # one row per step: GiGPO's verl-agent layout
    assert batch["anchor_obs_ids"].tolist() == expected
    adv, _ = core_algos.compute_advantage(batch.tensors, "gigpo", gamma=0.9, step_advantage_w=1.0)
    episode_only, _ = core_algos.compute_advantage(batch.tensors, "gigpo", gamma=0.9, step_advantage_w=0.0)
    assert torch.isfinite(adv).all() and not torch.equal(adv, episode_only)
