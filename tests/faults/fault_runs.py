"""Shared by the fault tests: a misbehaving-env tag per fault and a small GRPO run config."""

from __future__ import annotations

import dataclasses

from agent_trainer.agents.ctx_manager import ContextManager


FAULT_TAGS = {
    # tag: env_config of envs.examples.faulty:FaultyEnv (one group per tag, so one env actor per fault)
    "FaultyHangStep": {"fault": "hang_step"},
    "FaultyHangReset": {"fault": "hang_reset"},
    "FaultyRaiseStep": {"fault": "raise_step"},
    "FaultyRaiseReset": {"fault": "raise_reset"},
    "FaultyWrongTypes": {"fault": "wrong_types"},
    "FaultyNanReward": {"fault": "nan_reward"},
    "FaultyMegabytes": {"fault": "megabytes", "chars": 300_000},
    "FaultySurrogates": {"fault": "surrogates"},
}


class EveryReplyActs(ContextManager):
    """The default agent, except that a reply without a usable ``<answer>`` still acts (``Left``; the
    format error is counted as usual). The faults under test are the envs': every episode must reach its
    env's ``step`` whatever the untrained model writes, or which faults fire depends on its sampling."""

    def append_reply(self, ctx, token_ids, logprobs):
        inp = super().append_reply(ctx, token_ids, logprobs)
        return inp if inp.actions else dataclasses.replace(inp, actions=["Left"])


def write_fault_envs(path, extra_tags: dict | None = None) -> str:
    """config/envs.yaml plus one FaultyEnv tag per fault of :data:`FAULT_TAGS` (and ``extra_tags``); returns the
    file's path."""
    import yaml

    from agent_trainer.checks.prepare import CONFIG_DIR

    tags = yaml.safe_load((CONFIG_DIR / "envs.yaml").read_text())
    tags = tags.get("custom_envs", tags)
    for name, env_config in FAULT_TAGS.items():
        tags[name] = {"env_type": "envs.examples.faulty:FaultyEnv", "max_actions_per_traj": 3, "max_tokens": 24,
                      "env_instruction": "Answer with any word, e.g. <answer>Left</answer>.",
                      "env_config": env_config}
    tags.update(extra_tags or {})
    path.write_text(yaml.safe_dump({"custom_envs": tags}))
    return str(path)


def fault_config(model_path: str, run_dir, train_tags: list[str], *overrides: str, extra_tags: dict | None = None):
    """A small GRPO run (1 actor rank, no critic, 1 engine): one group of 2 episodes per train tag,
    one env actor per group, validation off, every reply an action (:class:`EveryReplyActs`), no env preflight
    (``es_manager.preflight``); ``extra_tags`` join the envs file; returns (cfg, env_tags)."""
    from hydra import compose, initialize_config_dir

    from agent_trainer.checks.prepare import CONFIG_DIR, prepare

    n = len(train_tags)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        raw = compose("frozenlake", overrides=[
            f"model_path={model_path}", f"trainer.default_local_dir={run_dir}",
            f"envs_file={write_fault_envs(run_dir / 'fault_envs.yaml', extra_tags)}",
            "trainer.total_training_steps=1", "trainer.test_freq=0", "trainer.save_freq=0",
            "trainer.progress_bar=false", "algorithm.adv_estimator=grpo", "algorithm.nonfinite_reward=drop",
            f"es_manager.train.env_groups={n}", "es_manager.train.group_size=2",
            f"es_manager.train.env_configs.tags=[{','.join(train_tags)}]",
            f"es_manager.train.env_configs.n_groups=[{','.join(['1'] * n)}]",
            f"es_manager.val.env_groups={n}", "es_manager.val.env_configs.tags=[Bandit]",
            f"es_manager.val.env_configs.n_groups=[{n}]",
            f"agent_proxy.num_env_actors={n}", "agent_proxy.num_cpus_per_env_actor=0.01", "agent_proxy.max_turn=2",
            "actor_rollout_ref.actor.fsdp.world_size=1", "ppo_mini_batch_size=2", "micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.response_length=24", "agent_proxy.agent_cls=fault_runs.EveryReplyActs",
            "es_manager.preflight=false",  # the faults must reach the run: the preflight would refuse (or hang on) them
            *overrides,
        ])
    return prepare(raw)
