"""Does a FrozenLake warm start read the holes? A probe at the forks, where exactly one of Down and Right is a hole.

    python -m launch.fork_probe --model outputs/agent_trainer/sft_frozenlake_nodeadends_seed0/final [--episodes 256]

Episodes of ``FrozenLakeNoDeadEnds`` on the held-out seeds (``es_manager.val``'s, seed 0) are walked by
``envs.frozen_lake.careless_walker`` with make train's reply format, through the rollout's env-state and context
managers. At every fork the model reads the prompt followed by ``<think>The best move now is`` (the reply's
decision token comes next) and the probe records: the policy's probability of the hole move (Down vs Right
renormalised), the Down-minus-Right logit difference, and the last layer's hidden state. It reports

- ``p_hole``: the mean probability of stepping onto the hole (0.5 blind, 0 for a reader that avoids holes);
- ``mean_abs_logit_diff``: how far from a coin flip the forks are;
- ``corr_logit_diff_hole_down``: the correlation of the logit difference with "the hole is Down" (how much the
  policy's choice follows the hole, either way);
- ``linear_probe_accuracy``: 5-fold cross-validated accuracy of a logistic regression from the hidden state to
  the hole's side (chance 0.5): whether the feature RL would have to scale is there at all.

docs/tiny_model.md ("Pipeline seeds") uses it to tell a start RL can re-aim from one it cannot.
"""

from __future__ import annotations

import argparse
import json
import random

import torch

DECISION_PREFIX = "<think>The best move now is"
TAG = "FrozenLakeNoDeadEnds"


def fork_states(model, tokenizer, envs_file: str, episodes: int, max_turn: int = 6, seed: int = 0):
    """(hidden state, Down-minus-Right logit, hole is Down) at every fork the careless walker reaches."""
    from agent_trainer.config.splits import Split
    from agent_trainer.ctx_manager import ContextManager
    from agent_trainer.demonstrations import reply_ids, reply_text
    from agent_trainer.es_manager import EnvStateManager, EpisodeSpec, group_seeds
    from envs import load_env_tags
    from envs.frozen_lake import careless_walker, down_right_neighbours
    from launch.validity_probe import walk

    ctx_mgr = ContextManager(tokenizer, enable_think=False)
    manager = EnvStateManager(load_env_tags(envs_file), [EpisodeSpec(env_id=i, group_id=i, tag=TAG)
                                                         for i in range(episodes)])
    prefix = tokenizer.encode(DECISION_PREFIX, add_special_tokens=False)
    [down], [right] = (tokenizer.encode(f" {a}", add_special_tokens=False) for a in ("Down", "Right"))
    rng, found = random.Random(seed), []

    def walked(turn, active):
        """The careless walker's replies; at a fork, first what the model reads there."""
        replies = []
        for ctx in active:
            env = manager.episodes[ctx.env_id].env
            inside = down_right_neighbours(env.desc, *env.position)
            holes = [name for name, (r, c) in inside.items() if env.desc[r][c] == "H"]
            if len(inside) == 2 and len(holes) == 1:
                with torch.no_grad():
                    out = model(torch.tensor([ctx_mgr.prompt_ids(ctx) + prefix]), output_hidden_states=True)
                logits = out.logits[0, -1]
                found.append((out.hidden_states[-1][0, -1].double(), float(logits[down] - logits[right]),
                              holes[0] == "Down"))
            ids = reply_ids(tokenizer, reply_text(careless_walker(env, rng)))
            replies.append((ids, [0.0] * len(ids)))
        return replies

    try:
        for _ in walk(manager, ctx_mgr, group_seeds(Split.VAL, episodes, 0, seed), max_turn, walked, 100):
            pass
    finally:
        manager.close()
    return found


def probe_accuracy(features: torch.Tensor, labels: torch.Tensor, folds: int = 5, l2: float = 1e-2) -> float:
    """Cross-validated accuracy of an L2-regularised logistic regression (LBFGS) from features to labels."""
    x = (features - features.mean(0)) / (features.std(0) + 1e-6)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    correct = 0
    for fold in range(folds):
        in_test = torch.arange(len(order)) % folds == fold
        test, train = order[in_test], order[~in_test]
        w = torch.zeros(x.shape[1], dtype=x.dtype, requires_grad=True)
        b = torch.zeros(1, dtype=x.dtype, requires_grad=True)
        opt = torch.optim.LBFGS([w, b], max_iter=200)

        def closure():
            opt.zero_grad()
            loss = (torch.nn.functional.binary_cross_entropy_with_logits(x[train] @ w + b, labels[train])
                    + l2 * w.square().sum())
            loss.backward()
            return loss

        opt.step(closure)
        with torch.no_grad():
            correct += int(((x[test] @ w + b > 0).to(labels.dtype) == labels[test]).sum())
    return correct / len(labels)


def probe(model_path: str, envs_file: str = "config/envs.yaml", episodes: int = 256) -> dict:
    """The figures of the module docstring for one model folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    found = fork_states(model, tokenizer, envs_file, episodes)
    if len(found) < 10:
        raise SystemExit(f"only {len(found)} forks reached in {episodes} episodes; raise --episodes")
    hidden = torch.stack([h for h, _, _ in found])
    diff = torch.tensor([d for _, d, _ in found], dtype=torch.float64)
    down = torch.tensor([float(is_down) for _, _, is_down in found], dtype=torch.float64)
    p_down = torch.sigmoid(diff)
    return {"model": str(model_path), "forks": len(found),
            "p_hole": round(float(torch.where(down.bool(), p_down, 1 - p_down).mean()), 3),
            "mean_abs_logit_diff": round(float(diff.abs().mean()), 3),
            "corr_logit_diff_hole_down": round(float(torch.corrcoef(torch.stack([diff, down]))[0, 1]), 3),
            "linear_probe_accuracy": round(probe_accuracy(hidden, down), 3)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a model folder (an SFT run's final/)")
    parser.add_argument("--envs-file", default="config/envs.yaml")
    parser.add_argument("--episodes", type=int, default=256, help="held-out episodes walked (forks come from them)")
    args = parser.parse_args(argv)
    result = probe(args.model, args.envs_file, args.episodes)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
