"""Small masked-statistics helpers shared by the estimators and losses.

Every helper treats ``mask`` as 0/1 weights of the same shape as ``values`` and
reads only the masked entries (``torch.where``, not ``values * mask``), so
garbage, ``inf`` or ``NaN`` outside the mask never leaks in. Empty masks give 0,
never NaN. Statistics are accumulated in float64 and cast back, so that
"all values equal" gives exactly-zero deviations instead of rounding noise
that a 1e-6 epsilon would blow up.
"""

from __future__ import annotations

import numpy as np
import torch

WHITEN_EPS = 1e-8
"""Added to the variance before ``rsqrt`` in :func:`masked_whiten`."""


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(values * mask) over ``dim`` (all elements if None); 0 where the mask is empty."""
    kept = torch.where(mask.bool(), values, torch.zeros_like(values))
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(values * mask) / sum(mask) over ``dim``; 0 (not NaN) where sum(mask) == 0."""
    total = masked_sum(values, mask, dim)
    count = mask.to(total.dtype).sum() if dim is None else mask.to(total.dtype).sum(dim)
    return total / count.clamp_min(1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked entries (scalar), Bessel-corrected when ``unbiased``.

    With n masked entries: var = sum_m (x - mean)^2 / (n - 1)  (n - 0 if not unbiased).
    Returns 0 when n <= 1 (a single entry has no spread), never NaN.
    """
    x = values.double()
    mean = masked_mean(x, mask)
    sq = masked_sum((x - mean) ** 2, mask)
    n = mask.double().sum()
    denom = n - 1 if unbiased else n
    return torch.where(denom > 0, sq / denom.clamp_min(1e-8), torch.zeros_like(sq)).to(values.dtype)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Whiten the masked entries: (x - mean) / sqrt(var + WHITEN_EPS), zeros outside the mask.

    Mean and (unbiased) variance are taken over all masked entries of the tensor.
    With ``shift_mean=False`` the mean is added back (scale only).
    Edge cases, all finite: no masked entry -> all zeros; one masked entry or
    zero variance -> x - mean = 0 for every entry, so the output is 0 (or the
    mean when ``shift_mean=False``).
    """
    x = values.double()
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    out = (x - mean) * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        out = out + mean
    return torch.where(mask.bool(), out, torch.zeros_like(out)).to(values.dtype)


def group_mean_std(scores: torch.Tensor, group_ids: torch.Tensor):
    """Per-element mean, unbiased std and size of the element's group.

    scores: [N] float, group_ids: [N] int64. Returns three [N] float64 tensors
    (mean, std, count). std of a group of one is 0 here; callers decide what a
    singleton group means for them.
    """
    x = scores.double()
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    count = torch.zeros(n_groups, dtype=torch.float64, device=x.device).index_add_(0, inverse, torch.ones_like(x))
    total = torch.zeros(n_groups, dtype=torch.float64, device=x.device).index_add_(0, inverse, x)
    mean = total / count
    sq = torch.zeros(n_groups, dtype=torch.float64, device=x.device).index_add_(0, inverse, (x - mean[inverse]) ** 2)
    std = torch.sqrt(sq / (count - 1).clamp_min(1))
    return mean[inverse], std[inverse], count[inverse]


def check_ids(name: str, ids: torch.Tensor, batch_size: int) -> None:
    """Raise ValueError unless ``ids`` is an integer tensor of shape [batch_size]."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.shape[0] != batch_size:
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"{name} must be an int64 tensor of shape [{batch_size}], got {shape}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer (int64) tensor, got dtype {ids.dtype}")


def as_group_index(name: str, ids, batch_size: int, device: torch.device | None = None) -> torch.Tensor:
    """Group / trajectory / anchor ids of any verl-accepted kind as an int64 tensor [batch_size].

    ``ids`` may be an integer tensor [B] (returned as int64, values kept), or, like verl's
    ``data.non_tensor_batch["uid"]``, a 1-D numpy array or a sequence of hashable ids
    (strings, ints, tuples, ...). Non-integer ids are numbered in order of first appearance,
    so two rows share an index exactly when their ids are equal; every estimator groups by
    equality only, so string ids give the same advantages as the equivalent ints.
    Float and bool ids are refused (NaN != NaN would split a group). Raises ValueError.
    """
    if isinstance(ids, torch.Tensor):
        check_ids(name, ids, batch_size)
        index = ids.long()
    elif isinstance(ids, np.ndarray) and ids.dtype.kind in "iu":
        index = torch.as_tensor(ids.astype(np.int64))
    else:
        index = _number_by_first_appearance(name, ids)
    if tuple(index.shape) != (batch_size,):
        raise ValueError(f"{name} must hold one id per row, shape [{batch_size}], got {tuple(index.shape)}")
    return index if device is None else index.to(device)


def _number_by_first_appearance(name: str, ids) -> torch.Tensor:
    """[N] int64: 0 for the first distinct id, 1 for the next new one, ..."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__") or getattr(ids, "ndim", 1) != 1:
        raise ValueError(f"{name} must be a 1-D array or sequence with one id per row, got {type(ids).__name__}")
    items = ids.tolist() if isinstance(ids, np.ndarray) else list(ids)
    if any(isinstance(v, (float, bool, np.floating, np.bool_)) for v in items):
        raise ValueError(f"{name} must hold integer or other non-float hashable ids (e.g. verl's string uids); "
                         "float and bool values are not ids")
    numbering: dict = {}
    try:
        return torch.tensor([numbering.setdefault(v, len(numbering)) for v in items], dtype=torch.long)
    except TypeError as err:  # an unhashable id (a list, a dict)
        raise ValueError(f"{name} ids must be hashable: {err}") from err


def check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise ValueError unless all given per-token tensors are 2-D and share one shape."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    first = next(iter(shapes.values()))
    if len(first) != 2 or any(s != first for s in shapes.values()):
        raise ValueError(f"per-token tensors must all have the same [batch, tokens] shape, got {shapes}")
