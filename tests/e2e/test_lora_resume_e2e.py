"""Exact resume of a LoRA run through the real command line: kill -9 mid-save, start the same command, compare.

tests/e2e/test_resume_e2e.py's procedure and tolerance (exact equality, wall-clock metrics aside) with
tests/e2e/test_lora_e2e.py's adapter: run A trains 3 steps uninterrupted; run B, the same command in another
folder, is SIGKILLed (its whole process group) while it writes step 2's checkpoint; started again it resumes from
step 1's checkpoint (the adapter and its AdamW state, RNG, env seeds; the base comes from ``model_path`` again)
and must end where A ended, metrics and adapter shards bit for bit.
"""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from test_lora_e2e import LORA, _is_adapter
from test_resume_e2e import _beside_a_kill_b_and_resume, _command, _metrics

pytestmark = pytest.mark.e2e


def test_a_lora_run_killed_mid_save_resumes_where_the_uninterrupted_run_ends(tiny_model_path, tmp_path):
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    overrides = (*LORA, "trainer.save_hf_model=false")
    resumed = _beside_a_kill_b_and_resume(_command(tiny_model_path, run_a, *overrides),
                                          _command(tiny_model_path, run_b, *overrides), run_b, tmp_path)
    assert f"resumed from {run_b / 'global_step_1'}" in resumed

    a, b = _metrics(run_a), _metrics(run_b)
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for step in (2, 3):
        assert a[step] == b[step], {k: (a[step][k], b[step].get(k)) for k in a[step] if a[step][k] != b[step].get(k)}
    folder = "global_step_3/actor/shards"
    shards = sorted(p.name for p in (run_a / folder).glob("*.safetensors"))
    assert shards == [f"{kind}-rank0000{r}-of-00002.safetensors" for kind in ("model", "optim") for r in (0, 1)]
    for name in shards:
        shard_a, shard_b = load_file(str(run_a / folder / name)), load_file(str(run_b / folder / name))
        assert shard_a.keys() == shard_b.keys() and all((shard_a[k] == shard_b[k]).all() for k in shard_a), name
        if name.startswith("model"):
            assert shard_a and all(_is_adapter(k) for k in shard_a)  # the adapter only, not the base model
