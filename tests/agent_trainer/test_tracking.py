"""Metric sinks: JSONL lines per step, TensorBoard event files, the console line, the phase timer, the progress bar;
the valid-action rate on the console and the one warning of a run whose first steps' actions are invalid."""

import json
import logging
import time
from pathlib import Path

import pytest

from agent_trainer.observe.tracking import CONSOLE_COLUMNS, LOW_VALIDITY_STEPS, Tracking, format_metrics, timer


def test_jsonl_and_tensorboard_sinks(tmp_path):
    tracking = Tracking(tmp_path, ["jsonl", "tensorboard"])
    tracking.log({"rollout/success_rate": 0.5, "actor/pg_loss": -0.1}, step=1)
    tracking.log({"rollout/success_rate": 0.75}, step=2)
    tracking.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, "rollout/success_rate": 0.5, "actor/pg_loss": -0.1},
                     {"step": 2, "rollout/success_rate": 0.75}]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("rollout/success_rate")] == [0.5, 0.75]



def test_rewind_drops_later_steps_from_jsonl_and_tensorboard(tmp_path):
    """An in-process restart from global_step_1 trains step 2 again: it must appear once, with its new value."""
    tracking = Tracking(tmp_path, ["jsonl", "tensorboard"])
    for step, value in ((1, 0.1), (2, 0.2), (3, 0.3)):
        tracking.log({"rollout/success_rate": value}, step=step)
    tracking.rewind(1)
    tracking.log({"rollout/success_rate": 0.25}, step=2)
    tracking.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(line["step"], line["rollout/success_rate"]) for line in lines] == [(1, 0.1), (2, 0.25)]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    scalars = acc.Scalars("rollout/success_rate")  # TensorBoard drops the purged events when it reads them
    assert [e.step for e in scalars] == [1, 2] and [e.value for e in scalars] == pytest.approx([0.1, 0.25])

def test_console_line_has_headline_metrics_only_aligned():
    line = format_metrics({"rollout/success_rate": 0.25, "perf/num_rows": 32.0, "timing_s/step": 3.21}, step=3,
                          total_steps=10)
    assert line == "step  3/10  succ 0.250  s   3.2"
    other = format_metrics({"rollout/success_rate": 1.0, "perf/num_rows": 32.0, "timing_s/step": 123.4}, step=10,
                           total_steps=10)
    assert len(other) == len(line) and other.index("  succ ") == line.index("  succ ") and \
        other.index("  s ") == line.index("  s ")


def test_every_console_column_is_explained_in_the_operations_guide():
    """docs/operations.md, "Console and logs": one row per column, naming its metric, so a user reading a console
    line (e.g. ``aside 3`` under dynamic sampling) finds what it counts."""
    guide = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    missing = [(key, label) for key, label, _ in CONSOLE_COLUMNS if f"| `{label}` | `{key}` |" not in guide]
    assert not missing, missing
    assert "aside   3" in format_metrics({"rollout/set_aside_groups": 3.0}, step=1)


def test_timer_accumulates_seconds():
    metrics: dict[str, float] = {}
    for _ in range(2):
        with timer("phase", metrics):
            time.sleep(0.01)
    assert metrics["timing_s/phase"] >= 0.02


def test_progress_bar_only_on_a_terminal(tmp_path):
    """The bar is drawn when stderr is a terminal and the key is on; a file or a pipe gets none."""
    import os

    from agent_trainer.training.trainer import show_progress_bar

    primary, secondary = os.openpty()
    try:
        with os.fdopen(secondary, "w", closefd=False) as tty:
            assert show_progress_bar(True, tty)
            assert not show_progress_bar(False, tty)
    finally:
        os.close(primary)
        os.close(secondary)
    with (tmp_path / "log").open("w") as log:
        assert not show_progress_bar(True, log)


def test_output_to_a_file_gets_one_line_per_step_and_no_bar(tmp_path, capfd):
    """``fit_steps`` with stdout and stderr captured (not a terminal): exactly one console line per step, no bar."""
    from types import SimpleNamespace

    from agent_trainer.config import AgentTrainerConfig
    from agent_trainer.training.trainer import AgentTrainer

    cfg = AgentTrainerConfig()
    cfg.trainer.total_training_steps, cfg.trainer.test_freq, cfg.trainer.save_freq = 3, 0, 0
    cfg.trainer.progress_bar = True
    trainer = AgentTrainer.__new__(AgentTrainer)
    trainer.cfg, trainer.global_step = cfg, 0
    trainer.tracking = Tracking(tmp_path, ["console"], cfg=cfg)
    trainer.train_step = lambda: {"rollout/success_rate": 0.5, "timing_s/step": 1.0}
    history = trainer.fit_steps(stop=SimpleNamespace(signum=None))
    assert len(history) == 3
    out, err = capfd.readouterr()
    assert out.splitlines() == [format_metrics(history[0], step, 3) for step in (1, 2, 3)]
    assert "training" not in err and "\r" not in out + err


def test_console_columns_name_the_valid_action_rate_and_the_ppo_kl():
    line = format_metrics({"rollout/success_rate": 0.0, "rollout/valid_action_rate": 0.25,
                           "rollout/format_error_rate": 0.5, "actor/ppo_kl": -4.7e-4}, step=1, total_steps=3)
    assert line == "step 1/3  succ 0.000  valid 0.25  fmt_err 0.50  ppo_kl -4.7e-04"


def test_the_valid_action_rate_is_the_episodes_mean_of_action_is_valid(tiny_model_path, tokenizer, play_mixed,
                                                                         mixed_manager):
    """MIXED_REPLIES by hand: env 0 two valid moves of four turns (0.5), env 1 none (0.0), env 2 one valid pull
    (1.0), env 3 a format error then a valid pull (0.5): 0.5; per tag FrozenLake3x3 0.25, Bandit 0.75."""
    from agent_trainer.agents.ctx_manager import ContextManager
    from agent_trainer.rollout.results import rollout_metrics

    played = play_mixed(ContextManager(tokenizer, max_model_len=4096))
    m = rollout_metrics(list(played.episodes.values()), mixed_manager.get_rollout_states(), "rollout")
    assert m["env/FrozenLake3x3/action_is_valid"] == pytest.approx(0.25)
    assert m["env/Bandit/action_is_valid"] == pytest.approx(0.75)
    assert m["rollout/valid_action_rate"] == pytest.approx(0.5)
    assert "valid 0.50" in format_metrics(m, 1)


def _fit(tmp_path, rates: list[float], caplog) -> list[str]:
    """``fit_steps`` over steps whose valid-action rates are ``rates``; the warnings the tracker logged."""
    from types import SimpleNamespace

    from agent_trainer.config import AgentTrainerConfig
    from agent_trainer.training.trainer import AgentTrainer

    cfg = AgentTrainerConfig()
    cfg.trainer.total_training_steps, cfg.trainer.test_freq, cfg.trainer.save_freq = len(rates), 0, 0
    cfg.envs_file = str(tmp_path / "my_envs.yaml")
    trainer = AgentTrainer.__new__(AgentTrainer)
    trainer.cfg, trainer.global_step = cfg, 0
    trainer.tracking = Tracking(tmp_path, ["jsonl"], cfg=cfg)
    steps = iter(rates)
    trainer.train_step = lambda: (lambda r: {"rollout/valid_action_rate": r, "env/Mine/action_is_valid": r})(next(steps))
    with caplog.at_level(logging.WARNING, logger="agent_trainer.observe.tracking"):
        trainer.fit_steps(stop=SimpleNamespace(signum=None))
    return [r.getMessage() for r in caplog.records if r.name == "agent_trainer.observe.tracking"]


def test_a_run_whose_first_steps_act_invalidly_warns_once_with_the_cause(tmp_path, caplog):
    [warning] = _fit(tmp_path, [0.0, 0.05, 0.0, 0.0, 0.0], caplog)
    assert f"for the first {LOW_VALIDITY_STEPS} step(s) (0.00, 0.05, 0.00" in warning and "['Mine']" in warning
    assert f"make model ENVS={(tmp_path / 'my_envs.yaml').resolve()}" in warning and "does not know" in warning


def test_no_warning_once_a_first_step_acts_validly_and_a_short_run_warns_at_its_end(tmp_path, caplog):
    assert _fit(tmp_path, [0.0, 0.5, 0.0, 0.0], caplog) == []
    caplog.clear()
    [warning] = _fit(tmp_path / "short", [0.0, 0.0], caplog)
    assert "for the first 2 step(s)" in warning
