"""Trajectory reward computers on hand-made trajectories: each format rule, each domain, ground truth, batching."""

from __future__ import annotations

import json

import pytest

from agent_trainer.checks.plugins import check_reward_computer
from agent_trainer.condensers import TrajectorySoFar
from agent_trainer.trajectory_rewards import (
    BatchTrajectoryRewardComputer,
    FinishedTrajectory,
    FormatValidationConfig,
    GroundTruth,
    IOCase,
    RewardComputationConfig,
    SandboxLimits,
    TrajectoryReward,
    TrajectoryRewardComputer,
    list_reward_computers,
    load_ground_truth,
    longest_row,
    make_reward_computer,
)

GOOD = "<think>reasoning</think><answer>{}</answer>"


def computer(domain="general", **kw):
    return make_reward_computer(RewardComputationConfig(domain=domain, **kw))


def traj(final: str, *, earlier=("<think>look</think>",), length=400, answers=("Paris",), tests="", io=()):
    truth = GroundTruth(answers=tuple(answers), tests=tests, io_cases=tuple(io))
    return FinishedTrajectory("q1", [*earlier, final], max_context_length=length, ground_truth=truth)


def test_a_correct_answer_earns_scale_over_the_longest_row_and_a_wrong_one_0():
    got = computer().compute(traj(GOOD.format("Paris"), length=400))
    assert got == TrajectoryReward(reward=1000.0 / 400, format_ok=True, correct=True, reason="ok",
                                   max_context_length=400, seconds=got.seconds)
    assert computer(efficiency_scale=1.0).compute(traj(GOOD.format("Paris"), length=400)).reward == 1 / 400
    wrong = computer().compute(traj(GOOD.format("Lyon")))
    assert (wrong.reward, wrong.format_ok, wrong.correct, wrong.reason) == (0.0, True, False, "wrong answer")
    # max_context_length is the longest row c_k + o_k, in tokens
    assert longest_row([100, 40, 300], [20, 90, 10]) == 310
    steps = TrajectorySoFar("task", "obs")
    for c, o in ((100, 20), (40, 90), (300, 10)):
        steps.add_step([0] * c, [0] * o, "next")
    assert steps.longest_row == 310


FORMAT_CASES = [
    # (rule overrides, final output, reason fragment when the rule is on)
    ({}, "Paris", "no <answer>"),
    ({"require_think_tag": True}, "<answer>Paris</answer>", "no non-empty <think>"),
    ({"require_think_tag": True}, "<answer>Paris</answer><think>late</think>", "no non-empty <think>"),
    ({"max_answer_chars": 3}, GOOD.format("Paris"), "5 characters > 3"),
    ({}, GOOD.format("   "), "empty answer"),
    ({"require_boxed": True}, GOOD.format("Paris"), "\\boxed"),
    ({"require_code_block": True}, GOOD.format("Paris"), "code block"),
]


@pytest.mark.parametrize("rules,final,reason", FORMAT_CASES)
def test_each_format_rule_gives_0_and_names_itself(rules, final, reason):
    got = computer(format_validation=FormatValidationConfig(**rules)).compute(traj(final))
    assert got.reward == 0.0 and not got.format_ok and not got.correct and reason in got.reason


def test_rules_switched_off_accept_the_same_answers():
    lenient = FormatValidationConfig(require_answer_tag=False, max_answer_chars=0, require_nonempty_outputs=False)
    assert computer(format_validation=lenient).compute(traj("Paris", earlier=("",))).correct
    assert computer(format_validation=FormatValidationConfig(require_think_tag=True)).compute(
        traj(GOOD.format("Paris"))).correct
    assert computer(domain="math", format_validation=FormatValidationConfig(require_boxed=True)).compute(
        traj(GOOD.format("\\boxed{4}"), answers=("4",))).correct
    blank_step = computer().compute(traj(GOOD.format("Paris"), earlier=("ok", "  ")))
    assert blank_step.reward == 0.0 and "step 2 has an empty output" in blank_step.reason


def test_general_answers_match_after_normalisation():
    assert computer().compute(traj(GOOD.format("  the PARIS. "))).correct
    assert computer().compute(traj(GOOD.format("Rome"), answers=("Paris", "Rome"))).correct
    assert not computer().compute(traj(GOOD.format("Pariss"))).correct


@pytest.mark.parametrize("said,gold,ok", [
    ("\\boxed{\\frac{1}{2}}", "0.5", True),
    ("The answer is: 1,000", "1000", True),
    ("x = 5", "5", True),
    ("Final answer: 3/4", "\\frac34", True),
    ("$\\dfrac{6}{8}$", "0.75", True),
    ("\\left( 2 \\right)", "(2)", True),
    ("\\boxed{7}", "8", False),
    ("seven", "7", False),
])
def test_math_answers_compare_as_numbers_fractions_or_latex(said, gold, ok):
    got = computer("math").compute(traj(GOOD.format(said), answers=(gold,)))
    assert got.correct is ok and (got.reward > 0) is ok


FAST = SandboxLimits(wall_s=30.0, cpu_s=2, mem_mb=256)
"""A busy loop is stopped by its 2 CPU seconds; the wall time is roomy, as a loaded machine stretches it (the
interpreter's start alone has taken more than 2 s there) and the programs that must pass would time out."""


def test_coding_answers_run_against_assert_tests_and_stdin_cases():
    code = computer("coding", sandbox=FAST)
    program = "```python\ndef add(a, b):\n    return a + b\n```"
    assert code.compute(traj(GOOD.format(program), tests="assert add(2, 3) == 5")).correct
    wrong = code.compute(traj(GOOD.format(program), tests="assert add(2, 3) == 5\nassert add(1, 1) == 3"))
    assert wrong.reward == 0.0 and wrong.format_ok and wrong.reason == "tests: failed (exit code 1)"
    echo = "```python\nn = int(input())\nprint(n * n)\n```"
    cases = [IOCase("3\n", "9\n"), IOCase("4\n", "16")]
    assert code.compute(traj(GOOD.format(echo), io=cases)).correct
    bad = code.compute(traj(GOOD.format(echo), io=[IOCase("3\n", "9"), IOCase("5\n", "24")]))
    assert not bad.correct and bad.reason == "io case 1: wrong output"
    crash = code.compute(traj(GOOD.format("raise SystemExit(3)"), tests="assert True"))
    assert crash.reward == 0.0 and "exit code 3" in crash.reason


def test_ground_truth_comes_from_the_row_else_from_the_file(tmp_path):
    jsonl = tmp_path / "gt.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in [
        {"id": "q1", "answer": "Paris"},
        {"question_id": 7, "tests": ["assert f() == 1", "assert f() != 2"]},
        {"id": "io", "tests": [{"input": "1", "output": "2"}]},
    ]))
    truths = load_ground_truth(jsonl)
    assert truths["q1"].answers == ("Paris",) and truths["7"].tests == "assert f() == 1\nassert f() != 2"
    assert truths["io"].io_cases == (IOCase("1", "2"),)
    mapping = tmp_path / "gt.json"
    mapping.write_text(json.dumps({"q1": "Paris", "q2": {"answer": ["4", "four"]}}))
    assert load_ground_truth(mapping)["q2"].answers == ("4", "four")

    from_file = computer(ground_truth_file=str(mapping))
    no_row = FinishedTrajectory("q1", [GOOD.format("Paris")], max_context_length=100)
    assert from_file.compute(no_row).correct
    row_wins = FinishedTrajectory("q1", [GOOD.format("Paris")], 100, ground_truth=GroundTruth(answers=("Rome",)))
    assert not from_file.compute(row_wins).correct
    with pytest.raises(ValueError, match="question 'q9' has no ground truth"):
        from_file.compute(FinishedTrajectory("q9", [GOOD.format("x")], 100))
    with pytest.raises(ValueError, match="ground_truth_file '/nope.json' does not exist"):
        computer(ground_truth_file="/nope.json")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"answer": "x"}))
    with pytest.raises(ValueError, match="record 0 has no 'id'"):
        load_ground_truth(bad)


class AlwaysHalf(TrajectoryRewardComputer):
    """A user computer found by import path."""

    def compute(self, trajectory):
        return TrajectoryReward(0.5, True, True, "ok", trajectory.max_context_length)


def test_registry_and_config_errors_name_the_key():
    assert list_reward_computers() == ["grpo"]
    user = make_reward_computer(RewardComputationConfig(type=f"{__name__}:AlwaysHalf"))
    assert user.compute(traj("anything")).reward == 0.5
    with pytest.raises(ValueError, match=r"reward_computation.type = 'ppo' is unknown; known: \['grpo'\]"):
        check_reward_computer(RewardComputationConfig(type="ppo"))  # the start-up check (agent_trainer.checks)
    with pytest.raises(ValueError, match=r"reward_computation.domain = 'chess' is not one of \['general'"):
        RewardComputationConfig(domain="chess")
    with pytest.raises(ValueError, match="max_answer_chars = -1"):
        FormatValidationConfig(max_answer_chars=-1)
    with pytest.raises(ValueError, match="efficiency_scale"):
        RewardComputationConfig(efficiency_scale=0)
    assert RewardComputationConfig(format_validation={"require_boxed": True}).format_validation.require_boxed


def test_batch_computes_in_parallel_in_order_with_per_item_timing():
    batch = BatchTrajectoryRewardComputer.from_config(
        RewardComputationConfig(domain="coding", num_workers=2, sandbox=FAST))
    ok = GOOD.format("```python\nimport time\ntime.sleep(0.5)\ndef f():\n    return 1\n```")
    items = [traj(ok, tests="assert f() == 1", length=100 * (i + 1)) for i in range(3)]
    items.insert(1, traj(GOOD.format("while True:\n    pass"), tests="assert True"))
    items.append(traj("no tags", tests="assert True"))
    out = batch.compute_batch(items)
    assert [r.reward for r in out.rewards] == [10.0, 0.0, 5.0, 1000.0 / 300, 0.0]
    assert [r.reason for r in out.rewards][1] == "tests: timed out" and "format" in out.rewards[4].reason
    assert all(r.seconds > 0 for r in out.rewards)
    assert out.seconds < sum(r.seconds for r in out.rewards) - 0.5  # two at a time, not one after another
    metrics = out.metrics()
    assert metrics["rollout/correct_rate"] == 0.6 and metrics["rollout/format_ok_rate"] == 0.8
    assert metrics["timing_s/reward_item_max"] == max(r.seconds for r in out.rewards)


def test_a_user_computer_by_import_path_loads_through_the_config_and_an_unknown_name_is_refused_before_ray(
        tiny_model_path):
    from agent_trainer.checks.prepare import compose_and_prepare

    base = [f"model_path={tiny_model_path}"]
    cfg, _ = compose_and_prepare([*base, f"reward_computation.type={__name__}:AlwaysHalf"], "multiturn_grpo_trainer")
    assert make_reward_computer(cfg.reward_computation).compute(traj("x")).reward == 0.5
    with pytest.raises(SystemExit) as exit_info:
        compose_and_prepare([*base, "reward_computation.type=nope"], "multiturn_grpo_trainer")
    assert exit_info.value.code == ("agent-trainer: reward_computation.type = 'nope' is unknown; known: ['grpo'], or "
                                    "give an import path 'package.module:ClassName'")
