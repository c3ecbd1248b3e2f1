"""Start-up checks of ``algorithm.distill`` (``agent_trainer.config.schema.DistillConfig``), before ``ray.init``:
a teacher to load, no key that would be ignored, no combination whose signal would go unused, and (with the
file system, from ``agent_trainer.checks.inputs.check_inputs``) a teacher that shares the student's vocabulary.
Each refusal is one line naming the key, the value and the fix."""

from __future__ import annotations

from agent_trainer import core_algos
from agent_trainer.checks.rules import changed_keys, check, get_key
from agent_trainer.config.schema import AgentTrainerConfig, DistillConfig

KEY = "algorithm.distill"


def check_distill(cfg: AgentTrainerConfig) -> None:
    """algorithm.distill.*: refused in one line when it cannot work (ranges and choices are in ``checks.rules``)."""
    d, alg = cfg.algorithm.distill, cfg.algorithm
    if not d.enable:
        changed = [key for key in changed_keys(d, DistillConfig(), KEY)
                   if key != f"{KEY}.log_prob_micro_batch_size_per_gpu"]
        check(not changed, f"{changed[0] if changed else KEY} = {get_key(cfg, changed[0]) if changed else ''!r} is "
                           f"set but {KEY}.enable = False, so no teacher is loaded; set {KEY}.enable=true or drop it")
        return
    check(bool(d.teacher_path.strip()),
          f"{KEY}.enable = True needs {KEY}.teacher_path (a Hugging Face causal-LM folder or hub id with the "
          f"student's tokenizer, or <run dir>/global_step_N/actor); e.g. {KEY}.teacher_path=models/tiny-qwen2")
    check(not d.fsdp.optimizer_offload,
          f"{KEY}.fsdp.optimizer_offload = True has nothing to move: the teacher has no optimizer; drop it "
          f"({KEY}.fsdp.param_offload keeps its weights in host memory)")
    if d.colocate:
        default = DistillConfig().fsdp
        for name in ("world_size", "num_cpus_per_rank", "num_threads", "mixed_precision"):
            value = getattr(d.fsdp, name)
            check(value == getattr(default, name),
                  f"{KEY}.fsdp.{name} = {value!r} is not used with {KEY}.colocate = True (the teacher is sharded over "
                  f"the actor's ranks, with actor_rollout_ref.actor.fsdp); drop it, or set {KEY}.colocate=false for "
                  "a teacher group of its own")
    estimator = core_algos.estimator(alg)
    if d.mode == "advantage":
        unused = [(core_algos.critic_enabled(cfg), f"algorithm.adv_estimator = {estimator!r} (its critic)"),
                  (alg.use_kl_in_reward, "algorithm.use_kl_in_reward = True"),
                  (cfg.judge.enable, "judge.enable = True"), (cfg.reward_model.enable, "reward_model.enable = True")]
        for on, what in unused:
            check(not on, f"{KEY}.mode = 'advantage' makes the teacher's per-token signal the whole advantage, so "
                          f"{what} would never reach the update; set {KEY}.mode=reward to add the signal to the "
                          f"rewards{', or algorithm.adv_estimator=grpo' if 'adv_estimator' in what else ''}, or "
                          "drop that key")
    else:
        check(not core_algos.estimator_spec(estimator).greedy_baseline,
              f"{KEY}.mode = 'reward' with algorithm.adv_estimator = {estimator!r}: the greedy baseline episodes are "
              "not scored by the teacher, so the baseline would miss the distillation reward; pick "
              "algorithm.adv_estimator=grpo")


def check_teacher_vocabulary(cfg: AgentTrainerConfig, student_config, teacher_config) -> None:
    """The teacher scores the student's token ids, so both read them with one tokenizer: the same token -> id
    table, and a teacher output layer at least as wide as the student's (any id the student can sample).
    ``student_config`` / ``teacher_config``: the two models' ``PretrainedConfig`` (already loaded)."""
    from transformers import AutoTokenizer

    student_path, teacher_path = cfg.actor_rollout_ref.model.path, cfg.algorithm.distill.teacher_path
    student, teacher = AutoTokenizer.from_pretrained(student_path), AutoTokenizer.from_pretrained(teacher_path)
    student_vocab, teacher_vocab = student.get_vocab(), teacher.get_vocab()
    if student_vocab != teacher_vocab:
        differ = sum(teacher_vocab.get(token) != i for token, i in student_vocab.items())
        raise ValueError(
            f"{KEY}.teacher_path = {teacher_path!r} has another vocabulary than the student "
            f"(actor_rollout_ref.model.path = {student_path!r}): the teacher's tokenizer has {len(teacher_vocab)} "
            f"tokens, the student's {len(student_vocab)} ({differ} of the student's tokens have another id or none "
            "in the teacher's); the teacher scores the student's token ids, so pick a teacher with the student's "
            "tokenizer (the same model family)")
    sizes = [getattr(c.get_text_config() if hasattr(c, "get_text_config") else c, "vocab_size", None)
             for c in (student_config, teacher_config)]
    if all(isinstance(n, int) for n in sizes) and sizes[1] < sizes[0]:
        raise ValueError(
            f"{KEY}.teacher_path = {teacher_path!r} has vocab_size = {sizes[1]} output logits, fewer than the "
            f"student's vocab_size = {sizes[0]} ({student_path!r}): a token id the student samples past "
            f"{sizes[1] - 1} has no teacher log-prob; pick a teacher with at least the student's vocab_size")
