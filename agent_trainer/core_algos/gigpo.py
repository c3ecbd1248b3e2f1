"""GiGPO: Group-in-Group Policy Optimization (Feng et al. 2025, arXiv:2505.10978; verl-agent)."""

from __future__ import annotations

import torch

from ._masked import as_group_index, check_same_shape, group_mean_std
from .advantages import normalize_by_group
from .multiturn import trajectory_scores, turn_summary
from .estimators import register_estimator

GIGPO_MODES = ("mean_norm", "mean_std_norm")


def step_relative_advantage(step_returns, group_ids, anchor_ids, epsilon: float, divide_by_std: bool):
    """Step-level GiGPO advantage over [S] steps, grouped by (group id, anchor observation id).

        A^S_s = G_s - mean_a              (mean_norm)
        A^S_s = (G_s - mean_a) / (std_a + epsilon)   (mean_std_norm; unbiased std)
    A step whose anchor state nobody else visited (a group of one) gets 0, as in verl-agent.
    """
    if step_returns.numel() == 0:
        return step_returns.double()
    _, anchor_group = torch.unique(torch.stack([group_ids, anchor_ids], dim=1), dim=0, return_inverse=True)
    mean, std, count = group_mean_std(step_returns, anchor_group)
    centred = step_returns.double() - mean
    adv = centred / (torch.where(count < 2, torch.ones_like(std), std) + epsilon) if divide_by_std else centred
    return torch.where(count < 2, torch.zeros_like(adv), adv)


def _per_step_rows_returns(row_rewards: torch.Tensor, row_to_traj: torch.Tensor, gamma: float) -> torch.Tensor:
    """Discounted return from each row over the later rows of its trajectory (rows in batch order)."""
    returns = torch.zeros_like(row_rewards, dtype=torch.float64)
    running: dict[int, float] = {}
    for i in reversed(range(row_rewards.shape[0])):
        traj = int(row_to_traj[i])
        running[traj] = float(row_rewards[i]) + gamma * running.get(traj, 0.0)
        returns[i] = running[traj]
    return returns


@register_estimator("gigpo", batch_keys=("uid", "anchor_obs_ids"),
                    optional_keys=("step_rewards", "traj_uid", "turn_ids"), layouts=("full", "condensed"),
                    options={"epsilon": "algorithm.gigpo.epsilon", "mode": "algorithm.gigpo.mode",
                             "step_advantage_w": "algorithm.gigpo.step_advantage_w"},
                    hyperparameters=("gamma",))
def compute_gigpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    step_rewards: torch.Tensor | None,
    response_mask: torch.Tensor,
    anchor_obs: torch.Tensor,
    index: torch.Tensor,
    traj_index: torch.Tensor | None = None,
    epsilon: float = 1e-6,
    step_advantage_w: float = 1.0,
    mode: str = "mean_norm",
    gamma: float = 1.0,
    turn_ids: torch.Tensor | None = None,
):
    """GiGPO advantage = episode-relative advantage + w * step-relative advantage.

    Episode level (paper eq. 3), over the distinct trajectories j of group g (``index``):
        R_j = sum of the trajectory's token rewards
        A^E_j = R_j - mean_g   (mode "mean_norm", verl-agent's default)
              | (R_j - mean_g) / (std_g + epsilon)   ("mean_std_norm")
        a group with one trajectory uses mean 0, std 1.
    Step level (eq. 5-7): every step s is one turn; its discounted return
        G_s = r_s + gamma * G_{s+1}   over the trajectory's later steps;
    steps of the same group whose anchor observation ids are equal form a step
    group, normalised like the episode level (a step group of one gives 0).
    Token advantage (eq. 8): A = A^E_j + step_advantage_w * A^S_s on each generated token.

    Two layouts, chosen by the shape of ``anchor_obs`` (int64 ids, e.g. hashes of the text; in the
    [B] layout also verl-agent's numpy array of observation strings). ``index`` / ``traj_index``
    are [B] int64 tensors or verl-style hashable ids (``_masked.as_group_index``):
      * [B, T]: one row per episode; steps are the row's turns (maximal runs of mask 1,
        or ``turn_ids``); a turn's anchor id is read at its first generated token;
        r_s = sum of the turn's rewards; each row is its own trajectory
        (``step_rewards`` must be None; ``traj_index``, if given, must not repeat).
      * [B]: one row per step (verl-agent layout); ``traj_index`` [B] is required;
        ``step_rewards`` [B] are the per-step discounted returns G_s if given,
        otherwise computed from each row's reward sum over the trajectory's rows in
        batch order (rows of a trajectory must be in step order). R_j sums all rows of j.

    Rows without any generated token (padding) get 0 and count in no statistic.
    Returns (advantages, returns), both equal, [B, T], zeros outside the mask.
    """
    check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    batch_size, device = token_level_rewards.shape[0], token_level_rewards.device
    index = as_group_index("index", index, batch_size, device)
    if traj_index is not None:
        traj_index = as_group_index("traj_index", traj_index, batch_size, device)
    if mode not in GIGPO_MODES:
        raise ValueError(f"gigpo mode = {mode!r} is not one of {list(GIGPO_MODES)}")
    divide = mode == "mean_std_norm"
    mask = response_mask.bool()
    with torch.no_grad():
        row_scores = torch.where(mask, token_level_rewards, 0.0).sum(-1)
        row_valid = mask.any(-1)
        if isinstance(anchor_obs, torch.Tensor) and anchor_obs.dim() == 2:
            if anchor_obs.shape != mask.shape:
                raise ValueError(f"anchor_obs [B, T] must match response_mask {tuple(mask.shape)}, "
                                 f"got {tuple(anchor_obs.shape)}")
            if step_rewards is not None:
                raise ValueError("with anchor_obs of shape [B, T] (one row per episode) step returns come "
                                 "from the turns' rewards; pass step_rewards=None")
            if traj_index is not None and torch.unique(traj_index).numel() != batch_size:
                raise ValueError("with anchor_obs of shape [B, T] each row is one whole episode, but traj_index "
                                 "repeats; use anchor_obs of shape [B] for one row per step")
            traj_index = torch.arange(batch_size, device=index.device)
            step_tok = _turn_step_advantage(token_level_rewards, mask, anchor_obs, index, turn_ids,
                                            gamma, epsilon, divide)
        else:
            if traj_index is None:
                raise ValueError("with anchor_obs of shape [B] (one row per step) traj_index [B] is required")
            anchor_obs = as_group_index("anchor_obs", anchor_obs, batch_size, device)
            _, row_to_traj = torch.unique(traj_index, return_inverse=True)
            if step_rewards is None:
                step_rewards = _per_step_rows_returns(row_scores, row_to_traj, gamma)
            elif step_rewards.shape != (batch_size,):
                raise ValueError(f"step_rewards must have shape [{batch_size}], got {tuple(step_rewards.shape)}")
            step_adv = torch.zeros(batch_size, dtype=torch.float64, device=mask.device)
            step_adv[row_valid] = step_relative_advantage(step_rewards[row_valid], index[row_valid],
                                                          anchor_obs[row_valid], epsilon, divide)
            step_tok = step_adv.unsqueeze(-1).expand(mask.shape)

        traj_score, traj_group, traj_valid, row_to_traj = trajectory_scores(row_scores, index, traj_index, row_valid)
        episode_adv = normalize_by_group(traj_score, traj_group, epsilon, divide, traj_valid)[row_to_traj]
        scores = episode_adv.unsqueeze(-1) + step_advantage_w * step_tok
        advantages = torch.where(mask, scores, 0.0).to(token_level_rewards.dtype)
    return advantages, advantages


def _turn_step_advantage(token_level_rewards, mask, anchor_obs, index, turn_ids, gamma, epsilon, divide):
    """[B, T] step-level advantage for the one-row-per-episode layout (steps = turns)."""
    seg, turn_reward, first_pos, _, valid = turn_summary(mask, token_level_rewards, turn_ids)
    n_cols = turn_reward.shape[1]
    turn_return = torch.zeros(mask.shape[0], n_cols + 1, dtype=torch.float64, device=mask.device)
    for k in range(n_cols - 1, 0, -1):
        g = turn_reward[:, k].double() + gamma * turn_return[:, k + 1]
        turn_return[:, k] = torch.where(valid[:, k], g, 0.0)
    rows, cols = valid.nonzero(as_tuple=True)
    step_adv = step_relative_advantage(turn_return[rows, cols], index[rows],
                                       anchor_obs.gather(1, first_pos)[rows, cols], epsilon, divide)
    table = torch.zeros(mask.shape[0], n_cols, dtype=torch.float64, device=mask.device)
    table[rows, cols] = step_adv
    return table.gather(1, seg)  # column 0 (outside the mask) stays 0
