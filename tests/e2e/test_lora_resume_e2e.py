"""Exact resume of a LoRA run (tests/e2e/test_lora_e2e.py's config) from its adapter checkpoint, in this process
on the e2e tests' shared cluster: the same tolerance as tests/e2e/test_resume_e2e.py, exact equality."""

import pytest

from test_lora_e2e import LORA, SMALL, _is_adapter

pytestmark = [pytest.mark.e2e, pytest.mark.shared_cluster]


def test_a_lora_run_resumed_from_its_adapter_checkpoint_ends_where_the_uninterrupted_run_ends(tiny_model_path,
                                                                                           tmp_path):
    """Run A: 3 steps, a checkpoint each step. Run B: resumes from A's step-1 checkpoint (the adapter, its AdamW
    state, RNG, env seeds; the base comes from model_path) and trains steps 2 and 3: the same metrics (but
    wall-clock ones) and bit-identical adapter and optimizer shards at step 3."""
    from safetensors.torch import load_file

    from e2e_runs import train_here
    from test_resume_e2e import _metrics

    common = [*SMALL, *LORA, "trainer.total_training_steps=3", "trainer.save_freq=1", "trainer.test_freq=0",
              "trainer.save_hf_model=false"]
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    train_here("frozenlake", tiny_model_path, run_a, *common)
    train_here("frozenlake", tiny_model_path, run_b, *common, "trainer.resume_mode=resume_path",
               f"trainer.resume_from_path={run_a / 'global_step_1'}")
    a, b = _metrics(run_a), _metrics(run_b)
    assert sorted(b) == [1, 2, 3]  # step 1's line came with the checkpoint
    assert not (run_b / "global_step_1").exists() and (run_b / "global_step_2").is_dir()  # B trained steps 2 and 3
    for step in (2, 3):
        assert a[step] == b[step], {k: (a[step][k], b[step].get(k)) for k in a[step] if a[step][k] != b[step].get(k)}
    shards = sorted(p.name for p in (run_a / "global_step_3" / "actor" / "shards").glob("*.safetensors"))
    assert shards == [f"{kind}-rank0000{r}-of-00002.safetensors" for kind in ("model", "optim") for r in (0, 1)]
    for name in shards:
        shard_a = load_file(str(run_a / "global_step_3" / "actor" / "shards" / name))
        shard_b = load_file(str(run_b / "global_step_3" / "actor" / "shards" / name))
        assert shard_a.keys() == shard_b.keys() and all((shard_a[k] == shard_b[k]).all() for k in shard_a), name
        if name.startswith("model"):
            assert shard_a and all(_is_adapter(k) for k in shard_a)  # the adapter only, not the base model
