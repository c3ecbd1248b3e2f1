"""RAGEN-2's prompt-response mutual information from a cross-scoring matrix (core_algos.collapse)."""

import math

import pytest
import torch

from agent_trainer.core_algos import mutual_information_estimates


def _replies_of(prompts: int, per_prompt: int) -> torch.Tensor:
    """own column of each reply: ``per_prompt`` replies to each prompt, grouped."""
    return torch.arange(prompts).repeat_interleave(per_prompt)


def test_replies_determined_by_their_prompt_give_log_m():
    m, k = 4, 3
    own = _replies_of(m, k)
    cross = torch.full((m * k, m), -60.0)  # each reply is likely only under its own prompt
    cross[torch.arange(m * k), own] = -2.0
    out = mutual_information_estimates(cross, own, lengths=torch.full((m * k,), 6))
    assert out["mi_seq_estimate"] == pytest.approx(math.log(m), abs=1e-9)
    assert out["mi_estimate"] == pytest.approx(math.log(m), abs=1e-3)  # per token the gap is 58/6 nats
    assert out["mi_upper_bound"] == pytest.approx(math.log(m))
    assert out["conditional_entropy_seq_est"] == pytest.approx(2.0)
    assert out["conditional_entropy_est"] == pytest.approx(2.0 / 6)
    assert out["num_prompts"] == m and out["num_responses"] == m * k


def test_replies_independent_of_the_prompt_give_zero():
    m, k = 5, 4
    own = _replies_of(m, k)
    per_reply = -torch.rand(m * k) * 30  # each reply has its own probability, the same under every prompt
    cross = per_reply[:, None].expand(m * k, m)
    out = mutual_information_estimates(cross, own, lengths=torch.randint(1, 20, (m * k,)))
    assert out["mi_seq_estimate"] == pytest.approx(0.0, abs=1e-9)
    assert out["mi_estimate"] == pytest.approx(0.0, abs=1e-9)
    # the replies still vary: high conditional entropy with zero MI is template collapse
    assert out["conditional_entropy_seq_est"] == pytest.approx(float(-per_reply.mean()))
    assert out["response_entropy_seq_est"] == pytest.approx(out["conditional_entropy_seq_est"])


def test_a_hand_computed_two_by_two_case():
    # p(r_0|x_0)=.5, p(r_0|x_1)=.25; p(r_1|x_0)=.1, p(r_1|x_1)=.4; r_0 answered x_0, r_1 answered x_1
    cross = torch.tensor([[0.5, 0.25], [0.1, 0.4]]).log()
    out = mutual_information_estimates(cross, torch.tensor([0, 1]), lengths=torch.tensor([1, 2]))
    # mixtures: (.5 + .25) / 2 = .375 and (.1 + .4) / 2 = .25
    assert out["mi_seq_estimate"] == pytest.approx((math.log(0.5 / 0.375) + math.log(0.4 / 0.25)) / 2)
    assert out["conditional_entropy_seq_est"] == pytest.approx(-(math.log(0.5) + math.log(0.4)) / 2)
    assert out["response_entropy_seq_est"] == pytest.approx(-(math.log(0.375) + math.log(0.25)) / 2)
    # per token: row 1's log-probs are halved before the mixture
    tok_1 = (math.log(0.4) / 2) - math.log((math.sqrt(0.1) + math.sqrt(0.4)) / 2)
    assert out["mi_estimate"] == pytest.approx((math.log(0.5 / 0.375) + tok_1) / 2)
    assert out["mi_upper_bound"] == pytest.approx(math.log(2))


def test_sampled_replies_estimate_the_exact_mutual_information():
    """Replies drawn from a categorical policy p(r|x): the estimate converges to the enumerated I(X;R)."""
    gen = torch.Generator().manual_seed(0)
    m, vocab, k = 3, 5, 4000
    table = torch.softmax(torch.randn(m, vocab, generator=gen) * 2, dim=-1)  # p(r | x_j)
    mix = table.mean(0)
    exact = float((table * (table / mix).log()).sum(-1).mean())
    own = _replies_of(m, k)
    replies = torch.multinomial(table[own], 1, generator=gen).flatten()
    cross = table[:, replies].T.log()  # [N, M]: log p(r_i | x_j)
    out = mutual_information_estimates(cross, own)
    assert exact > 0.1
    assert out["mi_seq_estimate"] == pytest.approx(exact, abs=0.03)
    assert "mi_estimate" not in out  # no lengths, no per-token variant


def test_never_above_log_m():
    gen = torch.Generator().manual_seed(1)
    for m in (2, 3, 8):
        cross = -torch.rand(40, m, generator=gen) * 50
        own = torch.randint(0, m, (40,), generator=gen)
        out = mutual_information_estimates(cross, own, lengths=torch.randint(1, 9, (40,), generator=gen))
        assert out["mi_seq_estimate"] <= math.log(m) + 1e-12
        assert out["mi_estimate"] <= math.log(m) + 1e-12


@pytest.mark.parametrize("cross, own, lengths, words", [
    (torch.zeros(0, 2), torch.zeros(0), None, "non-empty"),
    (torch.zeros(2, 2), torch.tensor([0, 2]), None, "own"),
    (torch.zeros(2, 2), torch.tensor([0, 1]), torch.tensor([1, 0]), "lengths"),
])
def test_malformed_inputs_are_refused(cross, own, lengths, words):
    with pytest.raises(ValueError, match=words):
        mutual_information_estimates(cross, own, lengths)
