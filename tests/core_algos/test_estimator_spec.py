"""``@register_estimator``: the specs drive the name tables, the dispatch and the start-up checks."""

from __future__ import annotations

import pytest
import torch

from agent_trainer import core_algos
from agent_trainer.checks.load import load_config
from agent_trainer.checks.rules import validate_algorithm_choices
from agent_trainer.core_algos import estimators as spec_module
from agent_trainer.core_algos import register_estimator
from agent_trainer.agents.ctx_manager import COLLATED_KEYS, TrainingRow, collate_rows


@pytest.fixture
def registry():
    """The registry, restored after the test (a toy estimator registered in a test does not leak)."""
    saved = dict(spec_module.ESTIMATOR_SPECS)
    yield spec_module.ESTIMATOR_SPECS
    spec_module.ESTIMATOR_SPECS.clear()
    spec_module.ESTIMATOR_SPECS.update(saved)


def test_the_tables_are_the_specs():
    specs = spec_module.ESTIMATOR_SPECS
    assert core_algos.ADV_ESTIMATOR_NAMES == core_algos.estimator_names() == tuple(specs)
    assert core_algos.CRITIC_ESTIMATORS == ("gae", "bi_level_gae")
    assert core_algos.ESTIMATOR_OPTIONS == {"grpo": ("epsilon",), "rloo": ("epsilon",),
                                           "reinforce_plus_plus_baseline": ("epsilon",),
                                           "grpo_multiturn": ("epsilon",),
                                           "gigpo": ("epsilon", "mode", "step_advantage_w")}
    assert core_algos.registry.ADV_ESTIMATORS == {name: s.fn for name, s in specs.items()}
    assert [n for n, s in specs.items() if s.compares_group] == [
        "grpo", "rloo", "reinforce_plus_plus_baseline", "grpo_multiturn", "gigpo"]
    assert [n for n, s in specs.items() if "condensed" in s.layouts] == ["grpo_multiturn", "gigpo"]
    assert [n for n, s in specs.items() if s.compares_turns] == ["gigpo"]
    assert [n for n, s in specs.items() if s.greedy_baseline] == ["remax"]
    assert specs["grpo_multiturn"].layouts == ("condensed",)


def _toy(token_level_rewards, response_mask, my_scores, gamma=1.0, scale=1.0):
    adv = (token_level_rewards.sum(-1) - my_scores)[:, None] * response_mask * scale * gamma
    return adv, adv


def test_a_registered_estimator_is_in_every_table_and_dispatched(registry):
    register_estimator("toy", batch_keys=("my_scores",), options={"scale": "algorithm.gamma"},
                       hyperparameters=("gamma",))(_toy)
    assert core_algos.ADV_ESTIMATOR_NAMES[-1] == "toy" and "toy" not in core_algos.CRITIC_ESTIMATORS
    assert core_algos.ESTIMATOR_OPTIONS["toy"] == ("scale",)
    validate_algorithm_choices(adv_estimator="toy", loss_agg_mode="token-mean", kl_loss_type="low_var_kl",
                               policy_loss_mode="vanilla", kl_ctrl_type="fixed")
    batch = {"token_level_rewards": torch.tensor([[0.0, 1.0]]), "response_mask": torch.tensor([[0.0, 1.0]]),
             "my_scores": torch.tensor([0.25])}
    adv, _ = core_algos.compute_advantage(batch, "toy", gamma=0.5, scale=2.0)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.75]]))
    with pytest.raises(ValueError, match=r"adv_estimator 'toy' needs batch\['my_scores'\]"):
        core_algos.compute_advantage({k: v for k, v in batch.items() if k != "my_scores"}, "toy")
    register_estimator("toy", batch_keys=("my_scores",), options={"scale": "algorithm.gamma"},
                       hyperparameters=("gamma",))(_toy)  # the same function again (a module reload): kept


def test_a_duplicate_name_is_refused(registry):
    def other(token_level_rewards, response_mask):
        return token_level_rewards, token_level_rewards

    with pytest.raises(ValueError, match="advantage estimator 'grpo' is registered twice: .*compute_grpo_outcome"):
        register_estimator("grpo")(other)
    assert core_algos.get_adv_estimator_fn("grpo") is core_algos.compute_grpo_outcome_advantage


@pytest.mark.parametrize("kwargs, message", [
    ({"needs_critic": True}, "needs_critic=True but 'values' is not in batch_keys"),
    ({"batch_keys": ("uid",)}, r"does not take \['index'\]"),
    ({"layouts": ("rows",)}, "layouts must be among"),
    ({"hyperparameters": ("lr",)}, "hyperparameters among"),
    ({"options": {"scale": "trainer.scale"}}, "options are read from the algorithm section"),
])
def test_a_spec_that_cannot_work_is_refused_at_registration(registry, kwargs, message):
    with pytest.raises(ValueError, match=message):
        register_estimator("broken", **kwargs)(_toy)
    assert "broken" not in core_algos.estimator_names()


def test_a_missing_batch_key_is_refused_at_start_up_naming_the_estimator(registry):
    register_estimator("toy", batch_keys=("my_scores",))(_toy)
    with pytest.raises(ValueError) as err:
        load_config({"algorithm": {"adv_estimator": "toy"}})
    line = str(err.value)
    assert "\n" not in line
    assert "algorithm.adv_estimator = 'toy' reads batch['my_scores'], which no part of this run makes" in line
    assert "pick another algorithm.adv_estimator" in line


def test_a_layout_the_estimator_does_not_read_is_refused_at_start_up(registry):
    register_estimator("toy_rows", batch_keys=("uid", "traj_uid"), layouts=("condensed",))(
        lambda token_level_rewards, response_mask, index, traj_index: (token_level_rewards, token_level_rewards))
    with pytest.raises(ValueError, match=r"algorithm.adv_estimator = 'toy_rows' needs one training row per turn, "
                                         r"but ctx_manager.mode = 'full'"):
        load_config({"algorithm": {"adv_estimator": "toy_rows"}})
    with pytest.raises(ValueError, match=r"ctx_manager.mode = 'condensed' makes one row per turn, which only "
                                         r"\['grpo_multiturn', 'gigpo', 'toy_rows'\] reads"):
        load_config({"ctx_manager": {"mode": "condensed"}})


def test_collate_rows_makes_the_collated_keys():
    row = TrainingRow(token_ids=[1, 2], response_mask=[0, 1], rewards=[0.0, 1.0], rollout_log_probs=[0.0, -0.5],
                      turn_ids=[0, 1], anchor_ids=[0, 3], group_id=0, traj_id=0, tag="t")
    assert set(collate_rows([row], pad_id=0).keys()) == set(COLLATED_KEYS)
