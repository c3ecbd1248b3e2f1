"""Does a FrozenLake warm start read the holes? A probe of the note and of the move at the forks.

    python -m launch.fork_probe --model outputs/agent_trainer/sft_frozenlake_nodeadends_seed0/final [--episodes 256]

Episodes of ``FrozenLakeNoDeadEnds`` on the held-out seeds (``es_manager.val``'s, seed 0) are walked by
``envs.frozen_lake.noting_walker`` in make train's reply format (``<think>Down: ice, Right: hole.</think>
<answer>Right</answer>``), through the rollout's env-state and context managers. At every turn the model reads
the prompt followed by the walker's reply, and the probe records whether its most likely token at each of the
note's two tile words is the right word (teacher-forced: the copy RL builds on). At every fork (exactly one of Down
and Right a hole) it also reads the prompt, the true note and ``<answer>`` (the move's first token comes next)
and records the policy's probability of the hole move (Down vs Right renormalised), the Down-minus-Right logit
difference, and the last layer's hidden state. It reports

- ``note_copy``: the share of the note's tile words (two per turn) the model names right;
- ``p_hole``: the mean probability of stepping onto the hole (0.5 blind, 0 for a reader that avoids holes);
- ``mean_abs_logit_diff``: how far from a coin flip the forks are;
- ``corr_logit_diff_hole_down``: the correlation of the logit difference with "the hole is Down" (how much the
  policy's choice follows the hole, either way);
- ``linear_probe_accuracy``: 5-fold cross-validated accuracy of a logistic regression from the hidden state to
  the hole's side (chance 0.5): whether the feature RL would have to scale is there at all;
- ``class_mean_distance`` and ``fisher_ratio``: the distance between the mean hidden states of the two sides and
  Fisher's ratio of that distance to the spread within each side (:func:`fisher_ratio`): how strongly, not only
  whether, the move's position carries the hole's side (docs/tiny_model.md, "What decides the click", sets it
  beside RL's outcome on the starts measured there).

docs/tiny_model.md ("Pipeline seeds") reads starts with it.
"""

from __future__ import annotations

import argparse
import json
import random

import torch

TAG = "FrozenLakeNoDeadEnds"


def fork_states(model, tokenizer, envs_file: str, episodes: int, max_turn: int = 6, seed: int = 0):
    """(hidden state, Down-minus-Right logit, hole is Down) at every fork the noting walker reaches, and the
    note's copy as (tile words named right, tile words)."""
    from agent_trainer.config.splits import Split
    from agent_trainer.agents.ctx_manager import ContextManager
    from agent_trainer.agents.demonstrations import reply_ids, reply_text
    from agent_trainer.episode.es_manager import EnvStateManager, EpisodeSpec, group_seeds
    from envs import load_env_tags
    from envs.frozen_lake import down_right_neighbours, noting_walker
    from launch.validity_probe import walk

    ctx_mgr = ContextManager(tokenizer, enable_think=True)
    manager = EnvStateManager(load_env_tags(envs_file), [EpisodeSpec(env_id=i, group_id=i, tag=TAG)
                                                         for i in range(episodes)])
    answer = tokenizer.encode("<answer>", add_special_tokens=False)
    [down], [right] = (tokenizer.encode(f"<answer>{a}", add_special_tokens=False)[len(answer):][:1]
                       for a in ("Down", "Right"))
    colon = tokenizer.encode(":", add_special_tokens=False)
    rng, found, copied = random.Random(seed), [], [0, 0]

    def walked(turn, active):
        """The noting walker's replies; first what the model makes of them."""
        replies = []
        for ctx in active:
            env = manager.episodes[ctx.env_id].env
            action, note = noting_walker(env, rng)
            prompt, ids = ctx_mgr.prompt_ids(ctx), reply_ids(tokenizer, reply_text(action, note))
            think = ids[: ids.index(answer[0])]
            with torch.no_grad():
                logits = model(torch.tensor([prompt + think])).logits[0]
            words = [k + 1 for k in range(len(think) - 1) if think[k : k + len(colon)] == colon]
            for k in words:  # the token after each ':' of the note is a tile word
                copied[0] += int(logits[len(prompt) + k - 1].argmax()) == think[k]
                copied[1] += 1
            inside = down_right_neighbours(env.desc, *env.position)
            holes = [name for name, (r, c) in inside.items() if env.desc[r][c] == "H"]
            if len(inside) == 2 and len(holes) == 1:
                with torch.no_grad():
                    out = model(torch.tensor([prompt + think + answer]), output_hidden_states=True)
                last = out.logits[0, -1]
                found.append((out.hidden_states[-1][0, -1].double(), float(last[down] - last[right]),
                              holes[0] == "Down"))
            replies.append((ids, [0.0] * len(ids)))
        return replies

    try:
        for _ in walk(manager, ctx_mgr, group_seeds(Split.VAL, episodes, 0, seed), max_turn, walked, 100):
            pass
    finally:
        manager.close()
    return found, copied


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


def fisher_ratio(features: torch.Tensor, labels: torch.Tensor, ridge: float = 1e-3) -> tuple[float, float]:
    """(distance of the two classes' means, Fisher's ratio d' S^-1 d): d the difference of the class means, S the
    pooled within-class covariance plus ``ridge`` times its mean diagonal (the hidden states outnumber the forks in
    some dimensions)."""
    ones, zeros = features[labels.bool()], features[~labels.bool()]
    d = ones.mean(0) - zeros.mean(0)
    centred = torch.cat([ones - ones.mean(0), zeros - zeros.mean(0)])
    cov = centred.T @ centred / max(len(centred) - 2, 1)
    cov = cov + ridge * cov.diagonal().mean() * torch.eye(len(d), dtype=cov.dtype)
    return float(d.norm()), float(d @ torch.linalg.solve(cov, d))


def probe(model_path: str, envs_file: str = "config/envs.yaml", episodes: int = 256) -> dict:
    """The figures of the module docstring for one model folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    found, (named, words) = fork_states(model, tokenizer, envs_file, episodes)
    if len(found) < 10:
        raise SystemExit(f"only {len(found)} forks reached in {episodes} episodes; raise --episodes")
    hidden = torch.stack([h for h, _, _ in found])
    diff = torch.tensor([d for _, d, _ in found], dtype=torch.float64)
    down = torch.tensor([float(is_down) for _, _, is_down in found], dtype=torch.float64)
    p_down = torch.sigmoid(diff)
    return {"model": str(model_path), "note_copy": round(named / max(words, 1), 3), "forks": len(found),
            "p_hole": round(float(torch.where(down.bool(), p_down, 1 - p_down).mean()), 3),
            "mean_abs_logit_diff": round(float(diff.abs().mean()), 3),
            "corr_logit_diff_hole_down": round(float(torch.corrcoef(torch.stack([diff, down]))[0, 1]), 3),
            "linear_probe_accuracy": round(probe_accuracy(hidden, down), 3),
            **dict(zip(("class_mean_distance", "fisher_ratio"), (round(v, 3) for v in fisher_ratio(hidden, down))))}


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
