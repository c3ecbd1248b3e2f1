"""The split is a typed value whose text is what files, metrics and checkpoints always held."""

import json

from agent_trainer.common.checkpoint import TrainerState
from agent_trainer.config.splits import CONFIG_SPLITS, Split
from agent_trainer.rollout import SPLITS, episode_seed, sampling_seed


def test_a_split_is_its_text():
    assert [str(s) for s in Split] == ["train", "val", "remax_baseline"]
    assert f"env_{Split.VAL}_0" == "env_val_0" and Split("remax_baseline") is Split.REMAX_BASELINE
    assert json.dumps({Split.TRAIN: 1, "split": Split.VAL}) == '{"train": 1, "split": "val"}'
    assert [s.metric_prefix for s in Split] == ["rollout", "val", "remax_baseline"]
    assert CONFIG_SPLITS == (Split.TRAIN, Split.VAL) and SPLITS == tuple(Split)


def test_seeds_are_the_same_for_the_text_and_the_member():
    assert sampling_seed(7, "val", 3, 1) == sampling_seed(7, Split.VAL, 3, 1)
    assert episode_seed(7, "remax_baseline", 3, 5, 1) == episode_seed(7, Split.REMAX_BASELINE, 3, 5, 1)


def test_a_checkpoint_written_with_text_keys_loads(tmp_path):
    (tmp_path / "trainer_state.json").write_text(json.dumps({"global_step": 2, "env_resets": {"train": 3, "val": 1}}))
    state = TrainerState.load(tmp_path)
    assert state.env_resets == {Split.TRAIN: 3, Split.VAL: 1}
    assert all(type(k) is Split for k in state.env_resets)
    state.save(tmp_path)
    assert json.loads((tmp_path / "trainer_state.json").read_text())["env_resets"] == {"train": 3, "val": 1}
