"""The CPU stack with vLLM's multiprocess client, the client every GPU engine runs: two PPO steps (weight syncs
included) in the one-GPU layout (``actor_rollout_ref.hybrid_engine``: the engine in the actor rank's placement-group
bundle). Every engine call crosses vLLM's msgpack encoder into the engine-core process, so a call the encoder refuses
(a Python function) or a weight that does not survive it fails here as it would on a GPU.

What only a GPU exercises: sleep mode (vLLM has none on CPU) and the CUDA weight transports; docs/architecture.md.
"""

import pytest
import ray

from e2e_runs import started

pytestmark = [pytest.mark.e2e, pytest.mark.shared_cluster]

RUN = [
    "trainer.total_training_steps=2",
    "trainer.test_freq=0",
    "trainer.progress_bar=false",
    "es_manager.train.env_groups=2",
    "es_manager.train.group_size=2",
    "es_manager.train.env_configs.tags=[Bandit]",
    "es_manager.train.env_configs.n_groups=[2]",
    "agent_proxy.num_env_actors=1",
    "ppo_mini_batch_size=4",
    "micro_batch_size_per_gpu=2",
    "agent_proxy.max_turn=1",
    "actor_rollout_ref.rollout.response_length=8",
    "actor_rollout_ref.actor.optim.lr=1e-3",
    "actor_rollout_ref.actor.recompute_old_log_prob=always",  # the log_prob phase reports the engine/actor gap
    "actor_rollout_ref.actor.fsdp.world_size=1",
    "actor_rollout_ref.hybrid_engine=true",
    "critic.enable=false",
    "algorithm.adv_estimator=grpo",
]


@pytest.fixture(scope="module")
def trained(tiny_model_path, tmp_path_factory):
    """Two steps with VLLM_ENABLE_V1_MULTIPROCESSING=1 in the engine's environment (the driver's value wins over
    the CPU default through agent_trainer.workers.build.engine_env_vars); yields the trainer (workers alive) and the
    metrics."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
        with started("frozenlake", tiny_model_path, tmp_path_factory.mktemp("mp"), *RUN) as trainer:
            yield trainer, trainer.fit()


def test_the_engine_runs_vllms_multiprocess_client(trained):
    trainer, _ = trained
    assert ray.get(trainer.engines[0].engine_core_client.remote()) == "SyncMPClient"


def test_engine_and_actor_log_probs_agree_after_each_sync(trained):
    """The engine sampled with the weights synced through the multiprocess client: its log-probs equal the
    actor's as closely as in the in-process runs (test_train_e2e: < 1e-3)."""
    _, history = trained
    assert len(history) == 2
    for metrics in history:
        assert metrics["actor/rollout_vs_actor_logprob_diff"] < 1e-3


def test_the_engine_runs_in_the_actor_ranks_bundle(trained):
    """hybrid_engine on CPU is real placement: the engine shares the actor's placement group and bundle 0, whose
    CPUs (the rank's and the engine's) are then all taken."""
    trainer, _ = trained
    pg = trainer.actor_wg.placement_group
    engine_pg = ray.get(trainer.engines[0].__ray_call__.remote(
        lambda self: ray.get_runtime_context().get_placement_group_id()))
    assert engine_pg == pg.id.hex()
    assert not trainer.engine_group.owns_placement_group
    assert ray.available_resources().get(f"CPU_group_0_{pg.id.hex()}", 0.0) == pytest.approx(0.0)
    assert not trainer.memory.active  # no sleep mode or offload on CPU: the fit loop makes no such call
