"""Multi-turn estimators: bi-level GAE, multi-turn GRPO (one row per turn), GiGPO.

Shapes as in advantages.py: per-token tensors are [B, T] over the whole
sequence, ``response_mask`` is 1 on generated tokens, ids are [B] (int64 tensors, or
verl-style numpy / list ids, see ``_masked.as_group_index``).

A *turn* is a maximal run of mask-1 tokens (the observation tokens between two
turns are mask 0). With explicit ``turn_ids`` ([B, T] int64) a new turn starts at
every generated token whose id differs from the previous generated token's id
(so two turns may touch, and a turn may contain mask-0 gaps). Turns are never
inferred from where rewards are non-zero: a zero-reward turn is still a turn.
"""

from __future__ import annotations

import torch

from ._masked import as_group_index, check_same_shape, masked_whiten
from .advantages import gae_scan, normalize_by_group
from .estimators import register_estimator


def turn_segments(response_mask: torch.Tensor, turn_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Number the turns of each row: [B, T] int64, 1..K_b on generated tokens, 0 elsewhere."""
    mask = response_mask.bool()
    if turn_ids is None:
        prev = torch.zeros_like(mask)
        prev[:, 1:] = mask[:, :-1]
        start = mask & ~prev
    else:
        if turn_ids.shape != mask.shape:
            raise ValueError(f"turn_ids must have shape {tuple(mask.shape)}, got {tuple(turn_ids.shape)}")
        pos = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
        last_gen = torch.where(mask, pos, torch.full_like(pos, -1)).cummax(dim=1).values
        prev_gen = torch.full_like(last_gen, -1)
        prev_gen[:, 1:] = last_gen[:, :-1]
        prev_id = turn_ids.gather(1, prev_gen.clamp_min(0))
        start = mask & ((prev_gen < 0) | (prev_id != turn_ids))
    return torch.cumsum(start.long(), dim=1) * mask.long()


def _turn_table(seg: torch.Tensor, per_token: torch.Tensor, reduce: str) -> torch.Tensor:
    """[B, K + 1] per-turn reduction ("sum", "amax" or "amin") of a [B, T] tensor; column 0 is junk."""
    n_turns = int(seg.max()) + 1 if seg.numel() else 1
    if reduce == "sum":
        table = torch.zeros(seg.shape[0], n_turns, dtype=per_token.dtype, device=seg.device)
        return table.scatter_add(1, seg, per_token)
    fill = -1 if reduce == "amax" else seg.shape[1]
    table = torch.full((seg.shape[0], n_turns), fill, dtype=per_token.dtype, device=seg.device)
    return table.scatter_reduce(1, seg, per_token, reduce=reduce, include_self=True)


def turn_summary(response_mask, token_level_rewards, turn_ids=None):
    """Per-turn table of a batch.

    Returns (seg [B, T], turn_reward [B, K+1], first_pos [B, K+1], last_pos [B, K+1],
    valid [B, K+1] bool). Column k >= 1 describes turn k; ``valid`` is False for
    column 0 and for turns a row does not have (their positions are clamped to 0).
    turn_reward = sum of the turn's token rewards (generated tokens only).
    """
    mask = response_mask.bool()
    seg = turn_segments(response_mask, turn_ids)
    pos = torch.arange(mask.shape[1], device=mask.device).expand_as(seg)
    rewards = torch.where(mask, token_level_rewards.float(), 0.0)
    turn_reward = _turn_table(seg, rewards, "sum")
    last_pos = _turn_table(seg, torch.where(mask, pos, -1), "amax")
    first_pos = _turn_table(seg, torch.where(mask, pos, mask.shape[1]), "amin")
    valid = last_pos >= 0
    valid[:, 0] = False
    return seg, turn_reward, first_pos.clamp(0, mask.shape[1] - 1), last_pos.clamp_min(0), valid


@register_estimator("bi_level_gae", needs_critic=True, batch_keys=("values",), optional_keys=("turn_ids",),
                    hyperparameters=("gamma", "lam", "high_level_gamma"))
def compute_bi_level_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    high_level_gamma: float,
    turn_ids: torch.Tensor | None = None,
):
    """Bi-level GAE: turn-level GAE across turns, then token-level GAE inside each turn
    (hierarchical credit assignment as in ArCHer, Zhou et al. 2024, arXiv:2402.19446;
    RAGEN's bi-level GAE, arXiv:2504.20073).

    Turns i = 1..K of a row (see module docstring), r_i = sum of turn i's token
    rewards, V_i = critic value at turn i's last generated token, V_{K+1} = A_{K+1} = 0:
        turn level:   delta_i = r_i + high_level_gamma * V_{i+1} - V_i
                      A_i     = delta_i + high_level_gamma * lam * A_{i+1}
                      R_i     = A_i + V_i                         (turn return)
        token level, inside turn i only (t' = next generated token of the same turn;
        after the turn's last token the value is 0 and the lambda trace restarts):
                      r'_t    = r_t, except at the turn's last token: r'_last = r_last + (R_i - r_i)
                      delta_t = r'_t + gamma * V_{t'} - V_t
                      A_t     = delta_t + gamma * lam * A_{t'}
        returns_t    = A_t + V_t (unwhitened);  advantages = whiten(A) over masked tokens.
    With this project's convention (a turn's reward sits on its last token) r'_last
    is exactly R_i and every other r'_t is 0. Rewards spread inside a turn (e.g.
    KL-in-reward) stay on their tokens and the last token gets the remainder, so
    a single-turn row gives plain GAE for any high_level_gamma. Under the convention
    the last token's advantage equals the turn advantage A_i. All-zero rewards, zero-reward turns
    and rows without any generated token are valid inputs.

    Args:
        token_level_rewards, values, response_mask: [B, T].
        gamma, lam: token-level discount and lambda (lam is also the turn-level lambda).
        high_level_gamma: turn-level discount.
        turn_ids: optional [B, T] int64 explicit turn ids.
    Returns:
        (advantages, returns), [B, T], zeros outside the mask.
    """
    check_same_shape(token_level_rewards=token_level_rewards, values=values, response_mask=response_mask)
    with torch.no_grad():
        values = values.float()
        mask = response_mask.bool()
        seg, turn_reward, _, last_pos, valid = turn_summary(response_mask, token_level_rewards, turn_ids)
        turn_value = torch.where(valid, values.gather(1, last_pos), 0.0)

        n_cols = turn_reward.shape[1]
        turn_adv = torch.zeros(values.shape[0], n_cols + 1, device=values.device)
        next_value = torch.zeros(values.shape[0], device=values.device)
        for k in range(n_cols - 1, 0, -1):
            delta = turn_reward[:, k] + high_level_gamma * next_value - turn_value[:, k]
            adv_k = delta + high_level_gamma * lam * turn_adv[:, k + 1]
            turn_adv[:, k] = torch.where(valid[:, k], adv_k, 0.0)
            next_value = torch.where(valid[:, k], turn_value[:, k], next_value)
        turn_return = turn_adv[:, :n_cols] + turn_value

        rewards = torch.where(mask, token_level_rewards.float(), 0.0)
        bonus = torch.where(valid, turn_return - turn_reward, 0.0)
        rewards = rewards.scatter_add(1, last_pos, bonus)
        is_last = (torch.zeros_like(seg).scatter_add(1, last_pos, valid.long()) > 0) & mask

        raw = gae_scan(rewards, values, response_mask, gamma, lam, segment_end=is_last)
        returns = torch.where(mask, raw + values, 0.0)
        advantages = masked_whiten(raw, response_mask)
    return advantages, returns


def trajectory_scores(row_scores: torch.Tensor, index: torch.Tensor, traj_index: torch.Tensor,
                      row_valid: torch.Tensor):
    """Sum row scores per trajectory.

    Returns (traj_score [n], traj_group [n], traj_valid [n] bool, row_to_traj [B]);
    a trajectory is valid when at least one of its rows has a generated token.
    Raises ValueError if one trajectory id appears under two group ids.
    """
    _, row_to_traj = torch.unique(traj_index, return_inverse=True)
    n_traj = int(row_to_traj.max()) + 1 if row_to_traj.numel() else 0
    traj_score = torch.zeros(n_traj, dtype=torch.float64, device=row_scores.device)
    traj_score = traj_score.index_add(0, row_to_traj, row_scores.double())
    traj_group = torch.zeros(n_traj, dtype=index.dtype, device=index.device).scatter(0, row_to_traj, index)
    if (traj_group[row_to_traj] != index).any():
        raise ValueError("a traj_index value appears with two different index (group) values; "
                         "trajectory ids must be unique across groups")
    traj_valid = torch.zeros(n_traj, dtype=torch.long, device=index.device).index_add(0, row_to_traj, row_valid.long())
    return traj_score, traj_group, traj_valid > 0, row_to_traj


@register_estimator("grpo_multiturn", batch_keys=("uid", "traj_uid"), layouts=("condensed",),
                    options={"epsilon": "algorithm.advantage_epsilon"},
                    hyperparameters=("norm_adv_by_std_in_grpo",))
def compute_grpo_multiturn_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: torch.Tensor,
    traj_index: torch.Tensor,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
):
    """Multi-turn GRPO for context condensation: one row per turn (c_k, o_k).

    Each row holds one turn of a trajectory: a condensed context c_k (mask 0) and
    the output o_k (mask 1). Rows carry ``index`` (question / group id) and
    ``traj_index`` (trajectory id). As in MemAgent's multi-conversation GRPO/DAPO
    (Yu et al. 2025, arXiv:2507.02259):
        S_j = sum of token rewards over every row of trajectory j   (one scalar per trajectory;
              put the outcome reward on one row, e.g. the last turn)
        A_j = (S_j - mean_g) / (std_g + epsilon)   over the n distinct trajectories of question g
              (S_j - mean_g if norm_adv_by_std_in_grpo is False; a single trajectory: mean 0, std 1)
        advantage of every output token of every row of trajectory j = A_j
    Each trajectory counts once in its group's statistics however many rows it has;
    a trajectory none of whose rows has a generated token (padding) does not count.

    Args:
        token_level_rewards, response_mask: [B, T]; index, traj_index: [B] ids (int64, or hashable ids).
    Returns:
        (advantages, returns), both equal, [B, T], zeros outside the mask.
    """
    check_same_shape(token_level_rewards=token_level_rewards, response_mask=response_mask)
    batch_size, device = token_level_rewards.shape[0], token_level_rewards.device
    index = as_group_index("index", index, batch_size, device)
    traj_index = as_group_index("traj_index", traj_index, batch_size, device)
    with torch.no_grad():
        row_scores = torch.where(response_mask.bool(), token_level_rewards, 0.0).sum(-1)
        row_valid = response_mask.bool().any(-1)
        traj_score, traj_group, traj_valid, row_to_traj = trajectory_scores(row_scores, index, traj_index, row_valid)
        traj_adv = normalize_by_group(traj_score, traj_group, epsilon, norm_adv_by_std_in_grpo, traj_valid)
        advantages = traj_adv[row_to_traj].to(token_level_rewards.dtype).unsqueeze(-1) * response_mask
    return advantages, advantages


class EpisodeStitch:
    """Rows of one episode read as one sequence: the view a one-row-per-episode estimator needs when an episode
    came as several rows (a gateway agent's step-wise rows: each call a row of its own prompt and reply).

    The episode's sequence is its rows' real tokens (the first ``lengths[b]`` of row b) one after another, in
    batch order; padding after it. Generated tokens keep their order, so a return flows from one row's reply to
    the next row's (GAE's bootstrap, REINFORCE++'s return-to-go), an outcome score sums every row (grpo, rloo:
    each episode counts once in its group) and turns stay turns (``turn_ids``, GiGPO's anchors).
    :meth:`to_episodes` maps a [B, T] tensor to [E, L] ([B] ids to [E]: the episode's first row's),
    :meth:`to_rows` maps an [E, L] result back to [B, T] (0 on padding).
    """

    def __init__(self, traj_index: torch.Tensor, lengths: torch.Tensor, width: int):
        self.rows, self.width = traj_index.shape[0], width
        _, self.row_to_episode = torch.unique(traj_index, return_inverse=True)
        self.episodes = int(self.row_to_episode.max()) + 1 if self.rows else 0
        lengths = lengths.long().clamp(0, width)
        offset = torch.zeros(self.rows, dtype=torch.long)
        filled = torch.zeros(self.episodes, dtype=torch.long)
        for b in range(self.rows):  # rows of an episode one after another, in batch order
            e = int(self.row_to_episode[b])
            offset[b], filled[e] = filled[e], filled[e] + lengths[b]
        self.length = int(filled.max()) if self.episodes else 0
        self.first_row = torch.full((self.episodes,), self.rows, dtype=torch.long).scatter_reduce(
            0, self.row_to_episode, torch.arange(self.rows), "amin")
        self.src_row = torch.repeat_interleave(torch.arange(self.rows), lengths)
        starts = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
        self.src_col = torch.arange(int(lengths.sum())) - starts
        self.dst_episode = self.row_to_episode[self.src_row]
        self.dst_pos = offset[self.src_row] + self.src_col

    def to_episodes(self, x):
        """[B, T] -> [E, L] (the episodes' sequences); [B] -> [E] (each episode's first row's); None stays."""
        if x is None:
            return None
        x = x if isinstance(x, torch.Tensor) else as_group_index("ids", x, self.rows)
        if x.dim() == 1:
            return x[self.first_row.to(x.device)]
        out = torch.zeros((self.episodes, self.length), dtype=x.dtype, device=x.device)
        out[self.dst_episode, self.dst_pos] = x[self.src_row, self.src_col]
        return out

    def to_rows(self, y: torch.Tensor) -> torch.Tensor:
        """[E, L] -> [B, T]: each row's tokens back from its episode's sequence, 0 on padding."""
        out = torch.zeros((self.rows, self.width), dtype=y.dtype, device=y.device)
        out[self.src_row, self.src_col] = y[self.dst_episode, self.dst_pos]
        return out
