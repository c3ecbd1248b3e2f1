"""Plain-loop reference implementations (python floats, one row at a time) for the tests."""

from __future__ import annotations

import math

import torch


def whiten_ref(x, mask):
    vals = [float(x[b, t]) for b in range(x.shape[0]) for t in range(x.shape[1]) if mask[b, t]]
    out = torch.zeros(x.shape, dtype=torch.float64)
    if not vals:
        return out
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1) if len(vals) > 1 else 0.0
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            if mask[b, t]:
                out[b, t] = (float(x[b, t]) - mean) / math.sqrt(var + 1e-8)
    return out


def turns_of_row(mask_row, turn_ids_row=None):
    """List of turns, each a list of generated positions."""
    turns, prev_id, prev_gen = [], None, -2
    for t, m in enumerate(mask_row):
        if not m:
            continue
        tid = int(turn_ids_row[t]) if turn_ids_row is not None else None
        new = (prev_gen != t - 1) if turn_ids_row is None else (not turns or tid != prev_id)
        if new:
            turns.append([])
        turns[-1].append(t)
        prev_id, prev_gen = tid, t
    return turns


def gae_row(rewards, values, positions, gamma, lam):
    """GAE over the given positions (in order), value 0 after the last one."""
    adv, next_v, next_a = {}, 0.0, 0.0
    for t in reversed(positions):
        delta = rewards[t] + gamma * next_v - values[t]
        next_a = delta + gamma * lam * next_a
        next_v = values[t]
        adv[t] = next_a
    return adv


def gae_ref(rewards, values, mask, gamma, lam):
    """Returns (raw advantages, returns) as float64 [B, T]."""
    raw = torch.zeros(rewards.shape, dtype=torch.float64)
    for b in range(rewards.shape[0]):
        pos = [t for t in range(rewards.shape[1]) if mask[b, t]]
        r = [float(x) for x in rewards[b]]
        v = [float(x) for x in values[b]]
        for t, a in gae_row(r, v, pos, gamma, lam).items():
            raw[b, t] = a
    returns = torch.where(mask.bool(), raw + values.double(), 0.0)
    return raw, returns


def bi_level_ref(rewards, values, mask, gamma, lam, hgamma, turn_ids=None):
    """Literal issue math: turn-level GAE, then token GAE per turn with last reward R_i."""
    raw = torch.zeros(rewards.shape, dtype=torch.float64)
    for b in range(rewards.shape[0]):
        r = [float(x) for x in rewards[b]]
        v = [float(x) for x in values[b]]
        turns = turns_of_row([bool(m) for m in mask[b]], None if turn_ids is None else turn_ids[b])
        k = len(turns)
        turn_r = [sum(r[t] for t in turn) for turn in turns]
        turn_v = [v[turn[-1]] for turn in turns]
        big_a = [0.0] * (k + 1)
        for i in reversed(range(k)):
            next_v = turn_v[i + 1] if i + 1 < k else 0.0
            big_a[i] = turn_r[i] + hgamma * next_v - turn_v[i] + hgamma * lam * big_a[i + 1]
        for i, turn in enumerate(turns):
            rr = {t: r[t] for t in turn}
            rr[turn[-1]] += big_a[i] + turn_v[i] - turn_r[i]
            for t, a in gae_row(rr, v, turn, gamma, lam).items():
                raw[b, t] = a
    returns = torch.where(mask.bool(), raw + values.double(), 0.0)
    return raw, returns


def group_norm_ref(scores, ids, eps, divide):
    """GRPO: singleton -> mean 0, std 1; unbiased std."""
    scores = [float(s) for s in scores]
    ids = [int(i) for i in ids]
    out = []
    for s, g in zip(scores, ids):
        members = [x for x, h in zip(scores, ids) if h == g]
        if len(members) == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(members) / len(members)
            std = math.sqrt(sum((x - mean) ** 2 for x in members) / (len(members) - 1))
        out.append((s - mean) / (std + eps) if divide else s - mean)
    return out
