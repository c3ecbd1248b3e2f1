"""The ``algorithm.distill`` keys are refused before Ray starts, in one line naming the key, the value and the fix,
when they cannot work: a missing teacher, a teacher with another vocabulary (its size named beside the student's),
keys set while distillation is off, and combinations whose signal would never reach the update."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from agent_trainer.checks.prepare import compose_and_prepare

D = "algorithm.distill"


def _prepare(model_path: str, *overrides: str):
    """What the command line does before ray.init (a refusal exits with its one line)."""
    return compose_and_prepare([f"model_path={model_path}", *overrides])


def _refused(model_path: str, *overrides: str) -> str:
    with pytest.raises(SystemExit) as err:
        _prepare(model_path, *overrides)
    message = str(err.value.code)
    assert "\n" not in message, message
    return message


def on(teacher: str, *more: str) -> list[str]:
    return ["algorithm.adv_estimator=grpo", f"{D}.enable=true", f"{D}.teacher_path={teacher}", *more]


def test_a_teacher_with_the_students_tokenizer_passes_and_the_teacher_group_runs_without_lora(tiny_model_path):
    cfg, _ = _prepare(tiny_model_path, *on(tiny_model_path, f"{D}.mode=reward", f"{D}.coef=0.5",
                                           "actor_rollout_ref.model.lora_rank=4"))
    d = cfg.algorithm.distill
    assert d.mode == "reward" and d.coef == 0.5
    teacher = d.teacher_model(cfg.actor_rollout_ref.model)
    assert teacher.path == tiny_model_path and teacher.lora_rank == 0
    assert not d.teacher_forward().colocate


@pytest.mark.parametrize("overrides, words", [
    ([f"{D}.enable=true", "algorithm.adv_estimator=grpo"], [f"{D}.enable = True needs {D}.teacher_path"]),
    ([f"{D}.teacher_path=models/tiny-qwen2"], [f"{D}.teacher_path = 'models/tiny-qwen2' is set but {D}.enable = False",
                                              f"{D}.enable=true"]),
    ([f"{D}.coef=2.0"], [f"{D}.coef = 2.0 is set but {D}.enable = False"]),
    (["TEACHER", f"{D}.coef=0"], [f"{D}.coef = 0", "must be > 0"]),
    (["TEACHER", f"{D}.mode=forward"], [f"{D}.mode", "forward", "advantage", "reward"]),
    (["TEACHER", "algorithm.adv_estimator=gae"], [f"{D}.mode = 'advantage'", "algorithm.adv_estimator = 'gae'",
                                                  "algorithm.adv_estimator=grpo"]),
    (["TEACHER", "algorithm.use_kl_in_reward=true"], ["algorithm.use_kl_in_reward = True would never reach",
                                                      f"{D}.mode=reward"]),
    (["TEACHER", f"{D}.mode=reward", "algorithm.adv_estimator=remax"],
     [f"{D}.mode = 'reward' with algorithm.adv_estimator = 'remax'", "algorithm.adv_estimator=grpo"]),
    (["TEACHER", f"{D}.fsdp.optimizer_offload=true"], [f"{D}.fsdp.optimizer_offload = True", "no optimizer"]),
    (["TEACHER", f"{D}.fsdp.param_offload=true", "trainer.device=cpu"], [f"{D}.fsdp.param_offload = True",
                                                                         "trainer.device = 'cpu'"]),
    (["TEACHER", f"{D}.dtype=float64"], [f"{D}.dtype = 'float64'"]),
    (["TEACHER", f"{D}.colocate=true", f"{D}.fsdp.world_size=2"],
     [f"{D}.fsdp.world_size = 2 is not used with {D}.colocate = True", f"{D}.colocate=false"]),
])
def test_a_distill_value_that_cannot_work_is_refused_in_one_line(tiny_model_path, overrides, words):
    if overrides[0] == "TEACHER":
        overrides = [*on(tiny_model_path), *overrides[1:]]
    message = _refused(tiny_model_path, *overrides)
    assert all(w in message for w in words), message


def test_a_missing_teacher_is_refused(tiny_model_path, tmp_path):
    message = _refused(tiny_model_path, *on(str(tmp_path / "no-teacher")))
    assert f"{D}.teacher_path = '{tmp_path / 'no-teacher'}' does not exist" in message


def test_a_teacher_with_another_tokenizer_is_refused_naming_both_vocabularies(tiny_model_path, tmp_path):
    teacher = tmp_path / "other-vocab"
    shutil.copytree(tiny_model_path, teacher)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    student_size = len(tokenizer.get_vocab())
    tokenizer.add_tokens(["<teacher-only-1>", "<teacher-only-2>"])  # another tokenizer: two more tokens
    tokenizer.save_pretrained(teacher)
    message = _refused(tiny_model_path, *on(str(teacher)))
    assert f"{D}.teacher_path = '{teacher}' has another vocabulary than the student" in message
    assert f"the teacher's tokenizer has {student_size + 2} tokens, the student's {student_size}" in message


def test_a_teacher_with_fewer_output_logits_than_the_student_is_refused_naming_both_sizes(tiny_model_path, tmp_path):
    teacher = tmp_path / "narrow"
    shutil.copytree(tiny_model_path, teacher)
    config = json.loads((teacher / "config.json").read_text())
    student_size = config["vocab_size"]
    config["vocab_size"] = student_size - 100  # the same tokenizer, a narrower output layer
    (teacher / "config.json").write_text(json.dumps(config))
    message = _refused(tiny_model_path, *on(str(teacher)))
    assert f"has vocab_size = {student_size - 100} output logits, fewer than the student's vocab_size = " \
           f"{student_size}" in message
