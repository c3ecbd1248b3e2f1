"""P1's baseline: the raw vLLM engine generating training steps' turns, nothing else.

Input (JSON): per training step, per turn, the contexts the multi-turn rollout sent to its
engine (token ids) and how many tokens it generated for each. The raw engine gets the same
contexts in the same per-turn batches and generates exactly as many tokens
(``min_tokens = max_tokens = n``, eos ignored), so both sides do the same work; the
difference is the rollout's own cost (tokenising, context building, env steps, Ray
hops). The engine is the project's (``agent_trainer.workers.rollout.engine_args``: float32, eager,
in-process, the same KV-cache size and seed) and each request asks for what the rollout's
requests ask for (``agent_trainer.workers.rollout.ROLLOUT_OUTPUTS``: the sampled token's logprob, no
text). For reference it also times vLLM's default outputs (text, no logprobs:
``tokens_only_seconds``). Every timed pass starts with an empty prefix cache, as the
rollout's step does after its weight sync. Writes JSON: per step, the median pass's seconds and tokens.

    python bench/raw_vllm.py --model models/tiny-qwen2 --turns turns.json --out raw.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

# As agent_trainer/workers/rollout.py: in-process engine, no thread pinning on shared cores.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def main() -> None:
    """Generate the first step's turns once untimed (warm-up), then ``--repeats`` timed passes per step (median)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--turns", required=True, help='JSON: [[[{"ids": [...], "n": 12}, ...], ...], ...] per step, '
                                                  'one list per turn')
    p.add_argument("--out", required=True)
    p.add_argument("--max-model-len", type=int, default=1536)
    p.add_argument("--kv-cache-gib", type=float, default=0.25)  # config/base.yaml rollout.kv_cache_space_gib
    p.add_argument("--repeats", type=int, default=3, help="timed passes per step; the median is reported")
    a = p.parse_args()

    from vllm import LLM, SamplingParams, TokensPrompt

    from agent_trainer.workers.rollout import ROLLOUT_OUTPUTS, engine_args

    steps = json.loads(Path(a.turns).read_text())
    llm = LLM(**engine_args(a.model, dtype="float32", max_model_len=a.max_model_len, seed=0,
                            kv_cache_space_gib=a.kv_cache_gib))

    def generate_all(turns: list[list[dict]], outputs: dict) -> tuple[float, int]:
        # The rollout's step starts with an empty prefix cache (every weight sync resets it, and its first-turn
        # prompts are new maps); without this reset a pass would find every prompt cached by the one before.
        # Within the pass, turn k still reuses turn k-1's blocks, as the rollout does.
        llm.reset_prefix_cache()
        seconds, tokens = 0.0, 0
        for batch in turns:
            prompts = [TokensPrompt(prompt_token_ids=row["ids"]) for row in batch]
            params = [SamplingParams(max_tokens=row["n"], min_tokens=row["n"], ignore_eos=True, temperature=1.0,
                                     **outputs) for row in batch]
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds += time.perf_counter() - start
            tokens += sum(len(o.outputs[0].token_ids) for o in outs)
        return seconds, tokens

    generate_all(steps[0], ROLLOUT_OUTPUTS)  # warm-up: the rollout's measured steps are not its first either
    # One pass of ~0.5 s swung by 15% between runs on this machine: the median of a few passes per step.
    passes: list[list] = [[] for _ in steps]
    tokens_only: list[list] = [[] for _ in steps]
    for _ in range(max(1, a.repeats)):  # alternating, so a change of load hits both alike
        for k, turns in enumerate(steps):
            passes[k].append(generate_all(turns, ROLLOUT_OUTPUTS))
            tokens_only[k].append(generate_all(turns, {}))
    out = []
    for turns, timed, plain in zip(steps, passes, tokens_only):
        seconds, tokens = median_pass(timed)
        out.append({"seconds": seconds, "generated_tokens": tokens, "pass_seconds": [s for s, _ in timed],
                    "tokens_only_seconds": median_pass(plain)[0], "tokens_only_pass_seconds": [s for s, _ in plain],
                    "turns": len(turns), "rows": sum(len(b) for b in turns)})
    Path(a.out).write_text(json.dumps({"steps": out, "repeats": max(1, a.repeats)}, indent=2))


def median_pass(passes: list[tuple[float, int]]) -> tuple[float, int]:
    """The (seconds, tokens) pass of median seconds (the upper one of an even count)."""
    return sorted(passes)[len(passes) // 2]


if __name__ == "__main__":
    main()
