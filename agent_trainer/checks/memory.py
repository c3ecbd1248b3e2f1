"""Start-up check of ``trainer.gpu_memory_gib``: a run whose per-GPU memory plan (``agent_trainer.checks.memory_plan``)
exceeds it is refused before ``ray.init``, in one line naming the setting to turn first."""

from __future__ import annotations

import math

from agent_trainer.config import AgentTrainerConfig
from agent_trainer.checks.memory_plan import Plan, build_plan, gib


def knob(plan: Plan, cfg: AgentTrainerConfig) -> str:
    """The setting to turn first for the worst GPU's peak."""
    kind, phase, _ = plan.worst()
    arr = cfg.actor_rollout_ref
    biggest = max(kind.lines, key=lambda line: line.bytes.get(phase, 0)).what
    if biggest.startswith("activations"):
        if not arr.model.enable_gradient_checkpointing:
            return "set actor_rollout_ref.model.enable_gradient_checkpointing=true"
        return (f"lower actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu (now "
                f"{arr.actor.ppo_micro_batch_size_per_gpu}) or rollout.max_model_len")
    if biggest.startswith("engine") and phase == "rollout":
        if not arr.actor.fsdp.optimizer_offload and kind.total(phase) > plan.gpu_memory:
            return ("set actor_rollout_ref.actor.fsdp.optimizer_offload=true and param_offload=true, or lower "
                    f"actor_rollout_ref.rollout.gpu_memory_utilization (now {arr.rollout.gpu_memory_utilization})")
        return f"lower actor_rollout_ref.rollout.gpu_memory_utilization (now {arr.rollout.gpu_memory_utilization})"
    if biggest.startswith("engine (awake"):  # under hybrid_engine, awake outside the rollout: sleep mode off
        return ("set actor_rollout_ref.rollout.enable_sleep_mode=null (on under hybrid_engine) or lower "
                f"actor_rollout_ref.rollout.gpu_memory_utilization (now {arr.rollout.gpu_memory_utilization})")
    if phase == "rollout" and not arr.actor.fsdp.optimizer_offload:
        return "set actor_rollout_ref.actor.fsdp.optimizer_offload=true and param_offload=true"
    if kind.name.startswith("engine"):
        return ("raise actor_rollout_ref.rollout.tensor_model_parallel_size "
                f"(now {arr.rollout.tensor_model_parallel_size})")
    if kind.name.startswith("critic"):
        return f"more GPUs: raise critic.fsdp.world_size (now {cfg.critic.fsdp.world_size})"
    if kind.name.startswith("reference"):
        return "set actor_rollout_ref.ref.fsdp.param_offload=true or actor_rollout_ref.ref.dtype=bfloat16"
    return f"more GPUs: raise actor_rollout_ref.actor.fsdp.world_size (now {arr.actor.fsdp.world_size})"


def check_gpu_memory(cfg: AgentTrainerConfig) -> None:
    """With ``trainer.gpu_memory_gib`` set: refuse, in one line naming the knob, a run whose plan exceeds it.

    Needs the model's config.json; when it cannot be read the check is left to
    ``agent_trainer.checks.inputs.check_inputs``, which refuses the model path itself.
    """
    memory = cfg.trainer.gpu_memory_gib
    if memory is None:
        return
    if not (isinstance(memory, (int, float)) and math.isfinite(memory) and memory > 0):
        raise ValueError(f"trainer.gpu_memory_gib = {memory!r} must be > 0 (GiB per GPU) or null; "
                         "e.g. trainer.gpu_memory_gib=80")
    if cfg.trainer.device == "cpu":
        raise ValueError(f"trainer.gpu_memory_gib = {memory} plans GPU memory, but trainer.device = 'cpu'; drop "
                         "trainer.gpu_memory_gib or set trainer.device=auto (or cuda)")
    try:
        plan = build_plan(cfg, memory)
    except (OSError, ValueError) as err:
        if "config.json" in str(err) or isinstance(err, OSError):
            return  # the model path is refused by check_inputs
        raise
    kind, phase, peak = plan.worst()
    if peak <= plan.gpu_memory:
        return
    top = sorted(kind.lines, key=lambda line: -line.bytes.get(phase, 0))[:3]
    parts = ", ".join(f"{line.what} {gib(line.bytes.get(phase, 0))}" for line in top)
    state = sum(line.bytes.get(phase, 0) for line in kind.lines
                if line.what.split()[0] in ("actor", "critic", "reference") and "activations" not in line.what)
    fix = knob(plan, cfg)
    if state > plan.gpu_memory and not fix.startswith("more GPUs"):
        fix += (f"; the sharded model state alone is {gib(state)} GiB, so also more GPUs "
                f"(actor_rollout_ref.actor.fsdp.world_size, now {cfg.actor_rollout_ref.actor.fsdp.world_size})")
    raise ValueError(f"trainer.gpu_memory_gib = {memory:g}: the plan's peak per GPU of the {kind.name} is "
                     f"{gib(peak)} GiB in the {phase} phase (largest: {parts} GiB); {fix} "
                     "(python -m agent_trainer.plan prints every GPU's table)")
