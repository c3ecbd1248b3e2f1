import pytest
import torch

from agent_trainer import core_algos
from agent_trainer.checks.rules import validate_algorithm_choices


def _batch():
    g = torch.Generator().manual_seed(1)
    mask = torch.tensor([[0.0, 1, 1, 0, 1, 0], [0, 1, 1, 1, 0, 0], [0, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    rewards = torch.zeros(4, 6)
    rewards[0, 2], rewards[0, 4], rewards[1, 3], rewards[2, 1] = 1.0, 0.5, 2.0, -1.0
    return {
        "token_level_rewards": rewards,
        "response_mask": mask,
        "values": torch.randn(4, 6, generator=g),
        "uid": torch.tensor([0, 0, 1, 1]),
        "traj_uid": torch.tensor([0, 1, 2, 3]),
        "anchor_obs_ids": torch.tensor([[7, 7, 7, 8, 8, 8]] * 4),
        "reward_baselines": torch.tensor([0.5, 0.5, 0.0, 0.0]),
    }


def test_registry_names_and_unknown_error():
    assert set(core_algos.ADV_ESTIMATOR_NAMES) == {
        "gae", "bi_level_gae", "grpo", "grpo_multiturn", "rloo", "reinforce_plus_plus",
        "reinforce_plus_plus_baseline", "remax", "gigpo"}  # in registration order (core_algos/__init__ imports)
    assert core_algos.get_adv_estimator_fn("gae") is core_algos.compute_gae_advantage_return
    with pytest.raises(ValueError) as err:
        core_algos.get_adv_estimator_fn("ppo")
    for name in core_algos.ADV_ESTIMATOR_NAMES:
        assert name in str(err.value)


@pytest.mark.parametrize("name", core_algos.ADV_ESTIMATOR_NAMES)
def test_compute_advantage_dispatches_every_estimator(name):
    batch = _batch()
    adv, ret = core_algos.compute_advantage(batch, name, gamma=0.9, lam=0.95, high_level_gamma=0.9)
    assert adv.shape == ret.shape == (4, 6)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    outside = ~batch["response_mask"].bool()
    assert (adv[outside] == 0).all() and (ret[outside] == 0).all()


def test_compute_advantage_passes_the_right_arguments():
    b = _batch()
    adv, ret = core_algos.compute_advantage(b, "gae", gamma=0.9, lam=0.95)
    ref = core_algos.compute_gae_advantage_return(b["token_level_rewards"], b["values"], b["response_mask"], 0.9, 0.95)
    torch.testing.assert_close(adv, ref[0])
    torch.testing.assert_close(ret, ref[1])
    adv, _ = core_algos.compute_advantage(b, "grpo", norm_adv_by_std_in_grpo=False, epsilon=1e-3)
    ref = core_algos.compute_grpo_outcome_advantage(b["token_level_rewards"], b["response_mask"], b["uid"],
                                                    1e-3, False)
    torch.testing.assert_close(adv, ref[0])


def test_compute_advantage_forwards_gigpo_options():
    b = _batch()
    adv, _ = core_algos.compute_advantage(b, "gigpo", gamma=0.9, step_advantage_w=0.0, mode="mean_std_norm")
    grpo, _ = core_algos.compute_advantage(b, "grpo")  # w = 0 and one row per trajectory: plain GRPO
    torch.testing.assert_close(adv, grpo)


def test_compute_advantage_missing_key_and_bad_kwarg():
    b = _batch()
    del b["values"]
    with pytest.raises(ValueError, match="values"):
        core_algos.compute_advantage(b, "gae")
    with pytest.raises(ValueError, match="does not take"):
        core_algos.compute_advantage(_batch(), "grpo", step_advantage_w=2.0)
    with pytest.raises(ValueError, match="known estimators"):
        core_algos.compute_advantage(_batch(), "vtrace")


def test_validate_algorithm_choices_messages_name_the_key():
    ok = dict(adv_estimator="gae", loss_agg_mode="token-mean", kl_loss_type="low_var_kl",
              policy_loss_mode="vanilla", kl_ctrl_type="fixed")
    validate_algorithm_choices(**ok)
    cases = {
        "adv_estimator": ("ppo", "algorithm.adv_estimator = 'ppo' is not one of"),
        "loss_agg_mode": ("mean", "actor_rollout_ref.actor.loss_agg_mode = 'mean' is not one of"),
        "kl_loss_type": ("full", "actor_rollout_ref.actor.kl_loss_type = 'full' is not one of"),
        "policy_loss_mode": ("cispo", "actor_rollout_ref.actor.policy_loss_mode = 'cispo' is not one of"),
        "kl_ctrl_type": ("pid", "algorithm.kl_ctrl.type = 'pid' is not one of"),
    }
    for key, (bad, message) in cases.items():
        with pytest.raises(ValueError) as err:
            validate_algorithm_choices(**{**ok, key: bad})
        assert message in str(err.value) and "set it to one of them" in str(err.value)
    with pytest.raises(ValueError, match="algorithm.bi_level_gae"):
        validate_algorithm_choices(**{**ok, "adv_estimator": "grpo"}, bi_level_gae=True)
    with pytest.raises(ValueError, match="algorithm.high_level_gamma"):
        validate_algorithm_choices(**ok, high_level_gamma=1.5)
    assert core_algos.resolve_adv_estimator("gae", bi_level_gae=True) == "bi_level_gae"
    assert core_algos.resolve_adv_estimator("grpo") == "grpo"


def test_constants_for_config_validation():
    assert core_algos.POLICY_LOSS_MODES == ("vanilla", "gspo")
    assert set(core_algos.KL_PENALTY_TYPES) == {"kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"}
    assert core_algos.LOSS_AGG_MODES == ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                         "seq-mean-token-sum-norm")
    assert core_algos.REWARD_NORM_GROUPINGS == ("state", "batch", "inductive")
    assert core_algos.REWARD_NORM_METHODS == ("identity", "mean", "mean_std", "asym_clip")
    assert core_algos.ROLLOUT_FILTER_STRATEGIES == ("top_k", "top_p", "min_p")


def _episodes():
    """4 episodes of one row each (2 groups), 3 turns each, right-padded: ids, masks, rewards, values, turns."""
    g = torch.Generator().manual_seed(3)
    # prompt (2) | turn 1 (2) | obs (1) | turn 2 (2) | obs (1) | turn 3 (1) | padding
    mask = torch.tensor([0, 0, 1, 1, 0, 1, 1, 0, 1, 0, 0], dtype=torch.float32).repeat(4, 1)
    turns = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2, 3, 0, 0]).repeat(4, 1)
    attention = torch.tensor([1] * 9 + [0, 0]).repeat(4, 1)
    rewards = torch.zeros(4, 11)
    rewards[:, 3], rewards[:, 6], rewards[:, 8] = torch.randn(4, 3, generator=g).unbind(1)
    anchors = torch.stack([torch.tensor([0, 0, 5, 5, 5, 6 + (b % 2), 6 + (b % 2), 6, 9, 0, 0]) for b in range(4)])
    return {"token_level_rewards": rewards, "response_mask": mask, "values": torch.randn(4, 11, generator=g),
            "uid": torch.tensor([0, 0, 1, 1]), "traj_uid": torch.tensor([10, 11, 12, 13]), "turn_ids": turns,
            "anchor_obs_ids": anchors, "attention_mask": attention, "reward_baselines": torch.tensor([.5, .5, 0., 0.])}


def _split(batch, row: int, at: int, context: int):
    """Row ``row`` as two rows of its episode (step-wise): its tokens before ``at``, then ``context`` tokens of its
    prompt again (mask 0, as a step-wise row's prompt) and its tokens from ``at``. Returns the batch and, per token
    of the original row, where it sits now (row, column)."""
    out, where = {}, []
    for key, x in batch.items():
        if x.dim() == 1:
            out[key] = torch.cat([x[:row + 1], x[row:]])
            continue
        first = torch.zeros_like(x[row])
        first[:at] = x[row, :at]
        second = torch.zeros_like(x[row])
        rest = x[row, at:9]
        second[:context] = x[row, :context] if key in ("attention_mask", "values") else 0
        second[context:context + len(rest)] = rest
        out[key] = torch.cat([x[:row], first[None], second[None], x[row + 1:]])
    where = [(row, c) for c in range(at)] + [(row + 1, context + c - at) for c in range(at, 9)]
    return out, where


@pytest.mark.parametrize("name", [n for n in core_algos.ADV_ESTIMATOR_NAMES
                                  if "full" in core_algos.estimator_spec(n).layouts])
def test_an_episode_in_several_rows_gets_the_advantages_it_gets_as_one_row(name):
    """A gateway agent's step-wise rows: the episode's calls as rows of their own (each with its prompt again as
    context). Every full-layout estimator reads them as the one episode they make: the same advantage and return
    on every generated token as the episode in one row (each episode counts once in its group, returns flow
    across its rows)."""
    batch = _episodes()
    whole = core_algos.compute_advantage(batch, name, gamma=0.9, lam=0.95, high_level_gamma=0.8)
    split, where = _split(batch, row=2, at=5, context=2)  # episode 12: turn 1 | prompt again, turns 2 and 3
    parts = core_algos.compute_advantage(split, name, gamma=0.9, lam=0.95, high_level_gamma=0.8)
    assert parts[0].shape == (5, 11)
    for full, part in zip(whole, parts):
        torch.testing.assert_close(torch.stack([part[r, c] for r, c in where]), full[2, :9])
        torch.testing.assert_close(part[[0, 1, 4]], full[[0, 1, 3]])  # the other episodes as they were
        assert (part[~split["response_mask"].bool()] == 0).all()


def test_grpo_counts_an_episode_of_several_rows_once_in_its_group():
    """Without the episode view, two rows of one episode would be two members of its group, each scored on part
    of the episode's reward."""
    batch = _episodes()
    split, _ = _split(batch, row=2, at=5, context=2)
    adv, _ = core_algos.compute_advantage(split, "grpo")
    scores = (batch["token_level_rewards"] * batch["response_mask"]).sum(-1)
    expected = (scores[2] - scores[2:].mean()) / (scores[2:].std() + 1e-6)
    assert torch.allclose(adv[2][split["response_mask"][2].bool()], expected.float())
    assert torch.allclose(adv[3][split["response_mask"][3].bool()], expected.float())
