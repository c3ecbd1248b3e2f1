"""What a warm start does on an RL config's held-out seeds when sampled as RL samples: ``make train`` prints it
before RL, so a user sees the start they got.

    python -m launch.warm_start_report --config-name frozenlake_nodeadends --model <SFT run>/final [key=value ...]

The RL config (composed and checked like a run) gives the held-out seeds (``es_manager.val``), the turn limit,
the prompt layout and the sampling (``actor_rollout_ref.rollout.temperature``, ``response_length``); episodes are
played by :func:`launch.validity_probe.probe_tag` (the rollout's env-state and context managers, the HF engine).
One line per validation tag: the share of replies in the answer format, of valid actions, FrozenLake's
``chose_hole`` (where exactly one of Down and Right is a hole, the share of moves onto it: about 0.5 for a policy
blind to the holes, 0 for one that reads them) and the sampled success. The RL run's step-0 validation then
gives the same start's greedy success.
"""

from __future__ import annotations

import argparse
import json


def report_line(result, temperature: float, n_seeds: int) -> str:
    """One tag's sampled figures as a line for the console."""
    hole = result.chose_hole_rate
    hole_text = ("" if hole is None else
                 f", chose_hole {hole:.2f} over {len(result.chose_hole)} turns with one hole beside (0.5 is blind "
                 "to the holes, 0 reads them)")
    return (f"Warm start on {n_seeds} held-out seeds of {result.tag}, sampled at temperature {temperature:g} as RL "
            f"samples: format {result.format_ok_rate:.2f}, valid actions {result.valid_rate:.2f}{hole_text}, "
            f"success {result.success_rate:.3f}.")


def main(argv: list[str] | None = None) -> list:
    """Compose the RL config, play its held-out seeds with the model, print a line per tag and a JSON summary."""
    from transformers import AutoTokenizer

    from agent_trainer.episode.es_manager import held_out_seeds
    from agent_trainer.checks.prepare import compose_and_prepare
    from launch.validity_probe import probe_tag
    from agent_trainer.workers.rollout import HFRolloutWorker

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config-name", default="frozenlake_nodeadends", help="the RL config (config/<name>.yaml)")
    parser.add_argument("--model", required=True, help="the warm start's model folder (an SFT run's final/)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the RL config")
    args = parser.parse_args(argv)
    cfg, env_tags = compose_and_prepare([*args.overrides, f"model_path={args.model}"], config_name=args.config_name)
    seeds = held_out_seeds(cfg)
    rollout = cfg.actor_rollout_ref.rollout
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    engine = HFRolloutWorker(str(args.model), seed=cfg.trainer.seed)
    results = []
    for tag in cfg.es_manager.val.tags:
        result = probe_tag(engine, tokenizer, env_tags, tag, turns=cfg.agent_proxy.max_turn, reset_seeds=seeds,
                           seed=cfg.trainer.seed, temperature=rollout.temperature,
                           response_length=rollout.response_length, enable_think=cfg.agent_proxy.enable_think)
        results.append(result)
        print(report_line(result, rollout.temperature, len(seeds)), flush=True)
    print(json.dumps({r.tag: {"format": round(r.format_ok_rate, 3), "valid": round(r.valid_rate, 3),
                              "chose_hole": None if r.chose_hole_rate is None else round(r.chose_hole_rate, 3),
                              "success": round(r.success_rate, 3)} for r in results}), flush=True)
    return results


if __name__ == "__main__":
    main()
