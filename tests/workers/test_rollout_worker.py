"""Rollout workers against a plain Hugging Face forward pass on the tiny model.

One vLLM engine serves the whole module (starting one takes seconds); the
weight-update test restores the original weights before it returns.
"""

from __future__ import annotations

import pytest
import torch

from agent_trainer.workers.rollout import GenerationOutput, HFRolloutWorker, VLLMRolloutWorker

MAX_ABS_DIFF = 1e-3


@pytest.fixture(scope="module")
def hf_model(tiny_model_path):
    """The reference: the same checkpoint through plain transformers."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def vllm_worker(tiny_model_path):
    """One in-process vLLM engine for the module, with a tiny KV cache; shut down after the module, so the
    process group it opened in this process does not reach the next module's tests."""
    worker = VLLMRolloutWorker(tiny_model_path, kv_cache_space_gib=0.125, max_model_len=512, seed=0)
    yield worker
    worker.shutdown()
    assert not torch.distributed.is_initialized()


@pytest.fixture(scope="module")
def hf_worker(tiny_model_path):
    """The HF-generate backend on the same checkpoint."""
    return HFRolloutWorker(tiny_model_path, max_model_len=512, seed=0)


@pytest.fixture(scope="module")
def chat_prompts(tiny_model_path):
    """Chat-formatted prompts of different lengths (exercises left padding in the HF worker)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    observations = ["P _ _ G", "P _\n_ O\n_ G", "# # #\n# P #\n# X #\n# O #", "Numbers: [3, 5]. Target: 8."]
    return [
        tok.apply_chat_template(
            [{"role": "system", "content": "You are a helpful agent."},
             {"role": "user", "content": f"Observation:\n{obs}\nReply."}],
            add_generation_prompt=True, return_dict=False,
        )
        for obs in observations
    ]


@torch.no_grad()
def hf_token_logprobs(model, seq: list[int]) -> list[float]:
    """Reference: log p(seq[t] | seq[:t]) from one unpadded forward pass; 0.0 at t=0."""
    logp = torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), dim=-1)
    return [0.0] + [logp[t - 1, seq[t]].item() for t in range(1, len(seq))]


def assert_generated_logprobs_match(model, prompts, outputs):
    """Each returned logprob equals the reference model's log_softmax on the same tokens."""
    for prompt, out in zip(prompts, outputs):
        assert isinstance(out, GenerationOutput) and out.finish_reason in ("stop", "length")
        assert len(out.logprobs) == len(out.token_ids) > 0
        ref = hf_token_logprobs(model, prompt + out.token_ids)[len(prompt):]
        assert max(abs(a - b) for a, b in zip(ref, out.logprobs)) < MAX_ABS_DIFF


def perturbed(model, scale: float) -> dict[str, torch.Tensor]:
    """The model's weights plus seeded noise; lm_head left out (tied: the worker derives it).

    Absolute noise: at init the logits are nearly flat and greedy decoding repeats one
    token; ``scale=0.2`` makes greedy outputs varied, so comparing them means something.
    """
    gen = torch.Generator().manual_seed(123)
    return {
        name: p.detach() + scale * torch.randn(p.shape, generator=gen)
        for name, p in model.state_dict().items()
        if name != "lm_head.weight"
    }


# --------------------------------------------------------------------------- vLLM


def test_vllm_sampled_logprobs_match_hf(vllm_worker, hf_model, chat_prompts):
    outputs = vllm_worker.generate(chat_prompts, max_tokens=24, temperature=1.0)
    assert_generated_logprobs_match(hf_model, chat_prompts, outputs)


def test_vllm_stop_tokens_budget_and_seed(vllm_worker, chat_prompts):
    first = vllm_worker.generate(chat_prompts, max_tokens=12, seed=7)
    again = vllm_worker.generate(chat_prompts, max_tokens=12, seed=7)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert all(o.finish_reason == "stop" or len(o.token_ids) == 12 for o in first)

    greedy = vllm_worker.generate(chat_prompts[:1], max_tokens=12, temperature=0)[0].token_ids
    stop = greedy[3]
    out = vllm_worker.generate(chat_prompts[:1], max_tokens=12, temperature=0, stop_token_ids=[stop])[0]
    assert out.finish_reason == "stop" and out.token_ids == greedy[: greedy.index(stop) + 1]

    # The context cap wins over max_tokens; a prompt that cannot fit is refused.
    long_prompt = (chat_prompts[0] * 40)[: 512 - 10]
    capped = vllm_worker.generate([long_prompt], max_tokens=64, temperature=0)[0]
    assert len(capped.token_ids) <= 10
    with pytest.raises(ValueError, match="max_model_len"):
        vllm_worker.generate([(chat_prompts[0] * 40)[:512]], max_tokens=4)
    assert len(vllm_worker.prompt_logprobs([(chat_prompts[0] * 40)[:511]])[0]) == 511
    with pytest.raises(ValueError, match="max_model_len"):
        vllm_worker.prompt_logprobs([(chat_prompts[0] * 40)[:512]])
    assert vllm_worker.generate([], max_tokens=4) == [] and vllm_worker.prompt_logprobs([]) == []


def test_vllm_update_weights_is_real(vllm_worker, hf_model, chat_prompts):
    from transformers import AutoModelForCausalLM

    original = {k: v.clone() for k, v in hf_model.state_dict().items()}
    new_weights = perturbed(hf_model, scale=0.2)
    seconds = vllm_worker.update_weights(new_weights)
    assert seconds > 0  # the time it took, reported (its size is a benchmark's question, not a test's)

    ref = AutoModelForCausalLM.from_config(hf_model.config).eval()
    ref.load_state_dict({**new_weights, "lm_head.weight": new_weights["model.embed_tokens.weight"]})
    greedy = vllm_worker.generate(chat_prompts, max_tokens=16, temperature=0)
    assert len(set(greedy[0].token_ids)) > 1
    for prompt, out in zip(chat_prompts, greedy):
        with torch.no_grad():
            hf_ids = ref.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                  eos_token_id=ref.config.eos_token_id, pad_token_id=ref.config.pad_token_id)
        assert out.token_ids == hf_ids[0, len(prompt):].tolist()
    sequences = [p + o.token_ids for p, o in zip(chat_prompts, greedy)]
    for seq, got in zip(sequences, vllm_worker.prompt_logprobs(sequences)):
        assert len(got) == len(seq) and got[0] == 0.0
        assert max(abs(a - b) for a, b in zip(got, hf_token_logprobs(ref, seq))) < MAX_ABS_DIFF
    # and it really changed: the original model disagrees
    assert max(abs(a - b) for a, b in zip(vllm_worker.prompt_logprobs(sequences[:1])[0],
                                          hf_token_logprobs(hf_model, sequences[0]))) > 0.01

    vllm_worker.update_weights(original)  # restore for the other tests (lm_head included this time)
    seq = sequences[0]
    assert max(abs(a - b) for a, b in zip(vllm_worker.prompt_logprobs([seq])[0],
                                          hf_token_logprobs(hf_model, seq))) < MAX_ABS_DIFF


def test_update_weights_rejects_wrapped_names(vllm_worker, hf_worker, hf_model, chat_prompts):
    wrapped = {f"_fsdp_wrapped_module.{k}": v for k, v in hf_model.state_dict().items()}
    for worker in (vllm_worker, hf_worker):
        before = worker.generate(chat_prompts, max_tokens=6, temperature=0)
        with pytest.raises(ValueError, match="unexpected|does not have"):  # HF engine | bucketed vLLM sync
            worker.update_weights(wrapped)
        # the refused state dict left the engine as it was: it generates the same greedy tokens
        after = worker.generate(chat_prompts, max_tokens=6, temperature=0)
        assert [o.token_ids for o in after] == [o.token_ids for o in before]


def test_sleep_and_wake_up_refuse_on_cpu_instead_of_doing_nothing(vllm_worker, hf_worker, tiny_model_path):
    """vLLM has no CPU sleep mode: asking for it is refused at creation, and sleep/wake_up without it raise
    (a silent no-op would hide a colocated layout that frees nothing)."""
    for worker in (vllm_worker, hf_worker):
        for call in (worker.sleep, worker.wake_up):
            with pytest.raises(RuntimeError, match="enable_sleep_mode"):
                call()
    with pytest.raises(ValueError, match="enable_sleep_mode needs a GPU"):
        HFRolloutWorker(tiny_model_path, device="cpu", enable_sleep_mode=True)


# --------------------------------------------------------------------------- HF generate


def test_hf_sampled_logprobs_match_forward(hf_worker, hf_model, chat_prompts):
    outputs = hf_worker.generate(chat_prompts, max_tokens=24, temperature=1.0, seed=3)
    assert_generated_logprobs_match(hf_model, chat_prompts, outputs)
    again = hf_worker.generate(chat_prompts, max_tokens=24, temperature=1.0, seed=3)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in again]


def test_hf_greedy_matches_vllm_and_prompt_logprobs(hf_worker, vllm_worker, hf_model, chat_prompts):
    weights = perturbed(hf_model, scale=0.2)
    hf_worker.update_weights(weights)
    vllm_worker.update_weights(weights)
    try:
        hf_out = hf_worker.generate(chat_prompts, max_tokens=16, temperature=0)
        vllm_out = vllm_worker.generate(chat_prompts, max_tokens=16, temperature=0)
        assert [o.token_ids for o in hf_out] == [o.token_ids for o in vllm_out]
        assert len(set(hf_out[0].token_ids)) > 1
        sequences = [p + o.token_ids for p, o in zip(chat_prompts, hf_out)]
        for a, b in zip(hf_worker.prompt_logprobs(sequences), vllm_worker.prompt_logprobs(sequences)):
            assert max(abs(x - y) for x, y in zip(a, b)) < MAX_ABS_DIFF
    finally:
        original = hf_model.state_dict()
        hf_worker.update_weights(original)
        vllm_worker.update_weights(original)


def test_hf_stop_token_and_context_cap(hf_worker, chat_prompts):
    greedy = hf_worker.generate(chat_prompts[:1], max_tokens=12, temperature=0)[0].token_ids
    stop = greedy[3]
    out = hf_worker.generate(chat_prompts[:1], max_tokens=12, temperature=0, stop_token_ids=[stop])[0]
    assert out.finish_reason == "stop" and out.token_ids == greedy[: greedy.index(stop) + 1]
    with pytest.raises(ValueError, match="max_model_len"):
        hf_worker.generate([(chat_prompts[0] * 40)[:512]], max_tokens=4)
    with pytest.raises(ValueError, match="max_model_len"):
        hf_worker.prompt_logprobs([(chat_prompts[0] * 40)[:512]])
    capped = hf_worker.generate([(chat_prompts[0] * 40)[: 512 - 10]], max_tokens=64, temperature=0)[0]
    assert len(capped.token_ids) <= 10
