"""Property-based checks over random shapes, masks (with observation gaps and padding rows) and groups."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_trainer import core_algos
from core_algos_refs import bi_level_ref, gae_ref

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def batches(draw):
    b = draw(st.integers(1, 6))
    t = draw(st.integers(1, 10))
    bits = draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))
    mask = torch.tensor(bits, dtype=torch.float32).view(b, t)
    floats = st.floats(-5, 5, allow_nan=False, width=32)
    rewards = torch.tensor(draw(st.lists(floats, min_size=b * t, max_size=b * t))).view(b, t)
    sparse = torch.tensor(draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))).view(b, t)
    values = torch.tensor(draw(st.lists(floats, min_size=b * t, max_size=b * t))).view(b, t)
    uid = torch.tensor(draw(st.lists(st.integers(0, 2), min_size=b, max_size=b)), dtype=torch.long)
    anchors = torch.tensor(draw(st.lists(st.integers(0, 2), min_size=b * t, max_size=b * t))).view(b, t)
    return {
        "token_level_rewards": rewards * sparse,
        "response_mask": mask,
        "values": values,
        "uid": uid,
        "traj_uid": torch.arange(b) + 100 * uid,  # trajectory ids unique across groups
        "anchor_obs_ids": anchors,
        "reward_baselines": values[:, 0],
    }



@SETTINGS
@given(batch=batches(), gamma=st.floats(0, 1), lam=st.floats(0, 1), hgamma=st.floats(0, 1))
def test_every_estimator_is_finite_and_zero_outside_mask(batch, gamma, lam, hgamma):
    outside = ~batch["response_mask"].bool()
    for name in core_algos.ADV_ESTIMATOR_NAMES:
        adv, ret = core_algos.compute_advantage(batch, name, gamma=gamma, lam=lam, high_level_gamma=hgamma)
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all(), name
        assert (adv[outside] == 0).all() and (ret[outside] == 0).all(), name


@SETTINGS
@given(batch=batches(), norm=st.booleans())
def test_grpo_per_group_mean_is_zero(batch, norm):
    mask = batch["response_mask"]
    adv, _ = core_algos.compute_grpo_outcome_advantage(batch["token_level_rewards"], mask, batch["uid"],
                                                       norm_adv_by_std_in_grpo=norm)
    valid = mask.bool().any(-1)
    row_adv = adv.sum(-1) / mask.sum(-1).clamp_min(1)  # the row's constant advantage
    for g in batch["uid"][valid].unique():
        rows = valid & (batch["uid"] == g)
        if rows.sum() >= 2:
            assert abs(float(row_adv[rows].mean())) < 1e-4


@SETTINGS
@given(batch=batches(), gamma=st.floats(0, 1), lam=st.floats(0, 1), hgamma=st.floats(0, 1))
def test_gae_and_bi_level_returns_match_loop_references(batch, gamma, lam, hgamma):
    r, v, m = batch["token_level_rewards"], batch["values"], batch["response_mask"]
    _, ret = core_algos.compute_gae_advantage_return(r, v, m, gamma, lam)
    torch.testing.assert_close(ret.double(), gae_ref(r, v, m, gamma, lam)[1], atol=1e-4, rtol=1e-4)
    _, ret = core_algos.compute_bi_level_gae_advantage_return(r, v, m, gamma, lam, hgamma)
    torch.testing.assert_close(ret.double(), bi_level_ref(r, v, m, gamma, lam, hgamma)[1], atol=1e-4, rtol=1e-4)


@SETTINGS
@given(batch=batches(), mode=st.sampled_from(core_algos.LOSS_AGG_MODES),
       kl_type=st.sampled_from(core_algos.KL_PENALTY_TYPES), policy_mode=st.sampled_from(core_algos.POLICY_LOSS_MODES))
def test_losses_are_finite(batch, mode, kl_type, policy_mode):
    m, v = batch["response_mask"], batch["values"]
    lp, old = -v.abs(), -batch["token_level_rewards"].abs()
    out = core_algos.get_policy_loss_fn(policy_mode)(old, lp, v, m, cliprange_low=0.2, cliprange_high=0.28,
                                                     loss_agg_mode=mode)
    assert all(torch.isfinite(x) for x in out)
    vf = core_algos.compute_value_loss(v, batch["token_level_rewards"], v * 0.5, m, 0.5, mode)
    assert all(torch.isfinite(x) for x in vf)
    assert torch.isfinite(core_algos.agg_loss(core_algos.kl_penalty(lp, old, kl_type), m, mode))


@SETTINGS
@given(scores=st.lists(st.floats(-3, 3, width=32), min_size=1, max_size=12), data=st.data(),
       grouping=st.sampled_from(core_algos.REWARD_NORM_GROUPINGS),
       method=st.sampled_from(core_algos.REWARD_NORM_METHODS),
       strategy=st.sampled_from(core_algos.ROLLOUT_FILTER_STRATEGIES), value=st.floats(0.05, 1.0))
def test_shaping_is_finite_and_keeps_whole_groups(scores, data, grouping, method, strategy, value):
    n = len(scores)
    x = torch.tensor(scores)
    ids = torch.tensor(data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)))
    out = core_algos.normalize_scores(x, ids, ids % 2, grouping, method)
    assert torch.isfinite(out).all()
    keep, ratio = core_algos.filter_groups(x, ids, strategy, value)
    assert 0 < ratio <= 1 and keep.any()
    for g in ids.unique():
        assert keep[ids == g].all() or not keep[ids == g].any()
