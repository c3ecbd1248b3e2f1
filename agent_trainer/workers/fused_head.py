"""The output head's scores of the taken tokens, computed in chunks: no [tokens x vocabulary] tensor is kept.

The trainer needs, per generated token, the log-probability of the token taken (at the rollout's temperature), and
with an entropy bonus the entropy of the next-token distribution; supervised fine-tuning also counts the tokens the
argmax predicts. The plain way projects every scored position to the whole vocabulary in float32 and keeps that
[N, V] tensor (and its log-softmax) for the backward: with a 151,936-token vocabulary the largest activation of the
update. :class:`ChunkedHeadScores` runs the projection and the softmax statistics ``chunk`` positions at a time,
keeps only the hidden states, the head's weight and the [N] results, and in the backward recomputes each chunk's
logits to form their gradient (the idea of fused linear cross-entropy kernels, written in torch so it runs on every
device):

    log p_T(y) = z_y / T - logsumexp(z / T)          d/dz = (onehot(y) - softmax(z / T)) / T
    H          = -sum_j p_j log p_j  (p = softmax(z)) d/dz = -p * (log p + H)

Within a chunk the softmax statistics run in place, so a chunk holds at most two float32 [chunk x vocabulary]
buffers in the forward and at temperature 1 in the backward (three at another temperature), where the plain head
holds its logits, their log-softmax and the gradients of both. The results equal the plain computation's to
float32 rounding, gradients included (tests/workers/test_fused_head.py). Under ``torch.autocast`` the projection
runs in the autocast dtype, as the plain head's ``nn.Linear`` would, and the softmax statistics in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from agent_trainer.checks.memory_plan import logit_chunk_rows, logits_untouched


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype the projection runs in: the autocast dtype when autocast is on for ``t``'s device, else ``t``'s."""
    kind = t.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return t.dtype


class ChunkedHeadScores(torch.autograd.Function):
    """``(log_prob [N], entropy [N], hits [N])`` of ``targets`` under ``hidden @ weight.T + bias``, chunk by chunk.

    ``entropy`` (temperature 1, as the plain :meth:`TargetLogits.entropy`) and ``hits`` (the argmax is the target,
    float 0/1, not differentiable) are empty tensors unless asked for. Gradients flow to ``hidden``, ``weight`` and
    ``bias`` from ``log_prob`` and ``entropy``.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, with_entropy: bool, with_hits: bool,
                chunk: int):
        dtype = _compute_dtype(hidden)
        n = hidden.shape[0]
        log_prob = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        hits = torch.empty(n if with_hits else 0, dtype=torch.float32, device=hidden.device)
        w = weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, n, chunk):  # at most two [chunk x vocabulary] buffers: z and logp
                end = min(n, start + chunk)
                z = F.linear(hidden[start:end].to(dtype), w, b).float()
                y = targets[start:end, None]
                if with_hits:
                    hits[start:end] = (z.argmax(-1) == targets[start:end]).float()
                logp = torch.log_softmax(z, -1) if with_entropy or temperature == 1.0 else None
                if temperature == 1.0:
                    log_prob[start:end] = logp.gather(-1, y).squeeze(-1)
                else:
                    log_prob[start:end] = _log_prob_at_(z, y, temperature)  # overwrites z
                if with_entropy:
                    entropy[start:end] = -_row_dot(torch.exp(logp, out=z), logp)  # p in z's buffer
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.settings = (temperature, with_entropy, chunk, dtype)
        ctx.mark_non_differentiable(hits)
        return log_prob, entropy, hits

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy, _grad_hits):
        hidden, weight, bias, targets = ctx.saved_tensors
        temperature, with_entropy, chunk, dtype = ctx.settings
        w = weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) \
            if bias is not None and ctx.needs_input_grad[2] else None
        n = hidden.shape[0]
        entropy_grad = with_entropy and grad_entropy is not None
        for start in range(0, n, chunk):  # two [chunk x vocabulary] buffers at temperature 1, three at another
            end = min(n, start + chunk)
            h = hidden[start:end].to(dtype)
            z = F.linear(h, w, b).float()
            term = None
            if entropy_grad:  # d entropy / dz = -p (logp + entropy), p = softmax(z) (temperature 1)
                logp = torch.log_softmax(z, -1)
                p = torch.exp(logp, out=z) if temperature == 1.0 else logp.exp()  # z is not read again at 1
                entropy = -_row_dot(p, logp)
                term = logp.add_(entropy[:, None]).mul_(p).mul_(grad_entropy[start:end, None].float())
                del logp  # its buffer is term's now
                if temperature != 1.0:
                    p = None  # at 1, p (in z's buffer) is the softmax the log-prob's gradient starts from
            if grad_log_prob is not None:
                g = grad_log_prob[start:end, None].float()
                if temperature == 1.0:
                    p_t = p if term is not None else _softmax_(z)
                else:
                    p_t = _softmax_(z.div_(temperature))
                grad_z = p_t.mul_(-g)
                grad_z.scatter_add_(-1, targets[start:end, None], g)
                if temperature != 1.0:
                    grad_z.div_(temperature)
                if term is not None:
                    grad_z.sub_(term)
            elif term is not None:
                grad_z = term.neg_()
            else:
                grad_z = torch.zeros_like(z)
            term = p = p_t = None
            grad_z = grad_z.to(dtype)
            if grad_hidden is not None:
                grad_hidden[start:end] = (grad_z @ w).to(hidden.dtype)
            if grad_weight is not None and dtype == torch.float32:
                grad_weight.addmm_(grad_z.t(), h)
            elif grad_weight is not None:
                grad_weight += (grad_z.t() @ h).float()
            if grad_bias is not None:
                grad_bias += grad_z.float().sum(0)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def _softmax_(z: torch.Tensor) -> torch.Tensor:
    """softmax over the last dimension, in ``z``'s own buffer."""
    z.sub_(z.amax(-1, keepdim=True)).exp_()
    return z.div_(z.sum(-1, keepdim=True))


def _log_prob_at_(z: torch.Tensor, y: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(z / temperature) at the columns ``y`` [n, 1], as [n]; overwrites ``z``."""
    z.div_(temperature)
    picked = z.gather(-1, y).squeeze(-1)
    top = z.amax(-1, keepdim=True)
    return picked - z.sub_(top).exp_().sum(-1).log_() - top.squeeze(-1)


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The dot product of each row of ``a`` with the same row of ``b`` [n, V] -> [n], without an [n, V] product."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def head_scores(hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor, temperature: float = 1.0,
                entropy: bool = False, hits: bool = False, chunk: int | None = None):
    """:class:`ChunkedHeadScores` of the output head ``head`` (an ``nn.Linear``) on ``hidden`` [N, H]."""
    rows = chunk or logit_chunk_rows(head.weight.shape[0])
    return ChunkedHeadScores.apply(hidden, head.weight, head.bias, targets, float(temperature), entropy, hits, rows)


def fusable(model: torch.nn.Module) -> bool:
    """True when ``model``'s logits are its output head's ``nn.Linear`` output, untouched after it (models that
    scale or soft-cap their logits after the head keep the plain head: ``logits_untouched``)."""
    head = model.get_output_embeddings()
    return type(head) is torch.nn.Linear and logits_untouched(getattr(model, "config", None))
