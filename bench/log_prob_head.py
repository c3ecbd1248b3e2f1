"""The scored tokens' log-probs through the output head, plain against chunked: time and memory of one pass.

    python bench/log_prob_head.py --model models/tiny-qwen2-20m --variant chunked --out /tmp/chunked.json

One process per variant (so its peak resident memory is its own): the model (float32, gradient checkpointing off,
as ``bench/run.py``'s P2 trains it) runs ``--rows`` right-padded rows of ``--width`` tokens, the last three quarters
of each scored, and the sum of the log-probs (with the entropy, as an entropy bonus asks) is backpropagated:

- ``plain``: the head projects the scored positions to the vocabulary and the log-softmax runs over the [N, V]
  float32 logits (``target_logits``, the workers' path before the chunked head);
- ``chunked``: ``target_scores`` (``agent_trainer/workers/fused_head.py``), the workers' path now.

Reported: the median seconds of a forward and backward (after a warm-up pass), the bytes autograd keeps for the
backward (every saved tensor's storage once, the parameters left out), the growth of the process's peak
resident memory over the passes, from the model loaded, and the peak memory of the log-prob itself: the head alone
on the scored tokens' hidden states (the model's output head, forward and backward), the most bytes live at once
above those live at its start, from torch.profiler's memory timeline (exact, unlike the resident memory, which the
allocator's cache blurs).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent_trainer.workers.fsdp_base import ModelInputs, scored_index, target_logits, target_scores  # noqa: E402


def pass_once(model, inputs, index, variant: str):
    """One forward (log-probs and entropy of the scored tokens) and its backward."""
    if variant == "plain":
        picked = target_logits(model, inputs, index)
        loss = picked.log_probs().sum() + 0.01 * picked.entropy().sum()
    else:
        scores = target_scores(model, inputs, index, entropy=True)
        loss = scores.log_probs.sum() + 0.01 * scores.entropy.sum()
    loss.backward()


def saved_bytes(model, inputs, index, variant: str) -> int:
    """Bytes of the tensors autograd keeps for the backward of one pass (parameters excluded)."""
    params = {p.data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        pass_once(model, inputs, index, variant)
    model.zero_grad(set_to_none=True)
    return sum(storages.values())


def head_peak_bytes(model, scored_tokens: int, variant: str) -> int:
    """Peak bytes of the log-prob and entropy of ``scored_tokens`` hidden states through ``model``'s output head,
    forward and backward, above what is live at the start (torch.profiler's memory timeline, CPU)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    from agent_trainer.workers.fused_head import head_scores

    head = model.get_output_embeddings()
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(scored_tokens, head.weight.shape[1], generator=gen, requires_grad=True)
    targets = torch.randint(0, head.weight.shape[0], (scored_tokens,), generator=gen)

    def run() -> None:
        if variant == "plain":  # target_logits' log_probs() and entropy() on the [N, V] logits
            logp = torch.log_softmax(head(hidden).float(), -1)
            loss = logp.gather(-1, targets[:, None]).sum() - 0.01 * (logp.exp() * logp).sum()
        else:
            log_prob, entropy, _ = head_scores(hidden, head, targets, entropy=True)
            loss = log_prob.sum() + 0.01 * entropy.sum()
        loss.backward()

    run()  # warm-up
    hidden.grad = None
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        run()
    model.zero_grad(set_to_none=True)
    with tempfile.TemporaryDirectory() as tmp:
        timeline = Path(tmp) / "memory.json"
        prof.export_memory_timeline(str(timeline), device="cpu")
        _, sizes = json.loads(timeline.read_text())
    live = [sum(categories) for categories in sizes]
    return max(live) - live[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--variant", choices=("plain", "chunked"), required=True)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    a = parser.parse_args()
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    model.config.use_cache = False
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (a.rows, a.width))
    scored = torch.zeros(a.rows, a.width, dtype=torch.long)
    scored[:, a.width // 4:] = 1
    inputs = ModelInputs(ids, None, torch.arange(a.width).expand(a.rows, a.width).clone(), counting_positions=True)
    index = scored_index(scored)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # the model loaded, no pass yet
    pass_once(model, inputs, index, a.variant)  # warm-up
    model.zero_grad(set_to_none=True)
    seconds = []
    for _ in range(a.repeats):
        start = time.perf_counter()
        pass_once(model, inputs, index, a.variant)
        seconds.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    rss_growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) * 1024
    result = {"variant": a.variant, "model": a.model.name, "rows": a.rows, "width": a.width,
              "scored_tokens": int(scored[:, 1:].sum()), "vocab": vocab,
              "n_params": sum(p.numel() for p in model.parameters()), "seconds": statistics.median(seconds),
              "all_seconds": seconds, "saved_bytes": saved_bytes(model, inputs, index, a.variant),
              "peak_rss_growth_bytes": rss_growth, "threads": torch.get_num_threads(),
              "head_peak_bytes": head_peak_bytes(model, int(index.targets.numel()), a.variant)}
    a.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
