"""launch.warm_start_report: make train's line on the warm start, from the RL config's own held-out seeds."""

from __future__ import annotations

import json

from launch import warm_start_report


def test_the_report_plays_the_configs_held_out_seeds_sampled(tiny_model_path, capsys):
    overrides = ["es_manager.val.env_groups=8", "es_manager.val.env_configs.n_groups=[8]", "trainer.seed=3"]
    [result] = warm_start_report.main(["--config-name", "frozenlake_nodeadends", "--model", tiny_model_path,
                                       *overrides])
    out = capsys.readouterr().out.splitlines()
    assert result.tag == "FrozenLakeNoDeadEnds" and result.episodes == 8 and 8 <= result.turns <= 8 * 6
    assert out[-2].startswith("Warm start on 8 held-out seeds of FrozenLakeNoDeadEnds, sampled at temperature 1 ")
    summary = json.loads(out[-1])["FrozenLakeNoDeadEnds"]
    assert summary["format"] == round(result.format_ok_rate, 3) and summary["success"] == round(result.success_rate, 3)
    assert summary["chose_hole"] is None or 0.0 <= summary["chose_hole"] <= 1.0
    assert 0 <= result.successes <= 8 and len(result.chose_hole) <= result.turns
