"""Template-collapse diagnostics (RAGEN-2): how much a response still depends on its prompt.

Under the batch's empirical prompt distribution, uniform over its ``M`` distinct prompts
``x_1 .. x_M``, and ``N`` sampled pairs ``(x_{c(i)}, r_i)`` (``c(i)``: the column of the prompt
response ``i`` answered):

- ``I(X; R) ~ mean_i [ log p(r_i | x_{c(i)}) - log( (1/M) sum_j p(r_i | x_j) ) ]``, the
  mutual information between prompt and response: each response is scored under every prompt
  (cross-scoring), and the second term, the log of the prompt mixture's probability, is a
  log-sum-exp over the row. It lies in ``[-inf, log M]`` sample by sample (the matched term is one of
  the summands), so the estimate never exceeds ``log M``, the entropy of the uniform prompt; it
  equals ``log M`` when every response is likely under its own prompt only, and is ~0 when the
  responses do not depend on the prompt. It is a finite-sample estimate: near 0 it may dip
  slightly below.
- ``H(R | X) ~ -mean_i log p(r_i | x_{c(i)})``, the conditional entropy (variability under one prompt).
- ``H(R) ~ -mean_i log( (1/M) sum_j p(r_i | x_j) )``, the marginal entropy; ``I = H(R) - H(R | X)``.

Each comes per sequence (``*_seq_*``: the response's summed log-probability) and per token
(the row's log-probabilities divided by the response's length before the log-sum-exp,
RAGEN's length-normalised variant that keeps long replies from dominating). Plain torch.
"""

from __future__ import annotations

import math

import torch


def mutual_information_estimates(cross_log_probs: torch.Tensor, own: torch.Tensor,
                                 lengths: torch.Tensor | None = None) -> dict[str, float]:
    """The template-collapse estimates from a cross-scoring matrix.

    ``cross_log_probs`` [N, M]: ``log p(r_i | x_j)``, the summed log-probability of response ``i``'s
    tokens after prompt ``j`` (every column a distinct prompt). ``own`` [N] int: the column of the
    prompt response ``i`` was sampled from. ``lengths`` [N]: response ``i``'s number of tokens, for the
    per-token variant (None: the per-token keys are left out).

    Returns (RAGEN's names): ``mi_estimate`` / ``mi_seq_estimate`` (per token / per sequence,
    nats), ``conditional_entropy_est`` / ``conditional_entropy_seq_est``,
    ``response_entropy_est`` / ``response_entropy_seq_est`` (the marginal ``H(R)``),
    ``mi_upper_bound`` (``log M``), ``num_prompts`` (M) and ``num_responses`` (N).
    """
    if cross_log_probs.dim() != 2 or cross_log_probs.shape[0] == 0 or cross_log_probs.shape[1] == 0:
        raise ValueError(f"cross_log_probs must be a non-empty [N, M] matrix, got shape {tuple(cross_log_probs.shape)}")
    n, m = cross_log_probs.shape
    own = torch.as_tensor(own, dtype=torch.long)
    if own.shape != (n,) or bool((own < 0).any()) or bool((own >= m).any()):
        raise ValueError(f"own must hold one column in [0, {m}) per row of the [{n}, {m}] matrix, got {own.tolist()}")
    out = {"mi_upper_bound": math.log(m), "num_prompts": float(m), "num_responses": float(n)}
    variants = {"_seq": cross_log_probs.double()}
    if lengths is not None:
        lengths = torch.as_tensor(lengths, dtype=torch.float64)
        if lengths.shape != (n,) or bool((lengths <= 0).any()):
            raise ValueError(f"lengths must be [{n}] positive token counts, got {lengths.tolist()}")
        variants[""] = cross_log_probs.double() / lengths[:, None]
    for suffix, scores in variants.items():
        matched = scores[torch.arange(n), own]
        marginal = torch.logsumexp(scores, dim=1) - math.log(m)  # log of the uniform prompt mixture
        out[f"mi{suffix}_estimate"] = float((matched - marginal).mean())
        out[f"conditional_entropy{suffix}_est"] = float(-matched.mean())
        out[f"response_entropy{suffix}_est"] = float(-marginal.mean())
    return out
