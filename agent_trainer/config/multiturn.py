"""Seed 004's multi-turn GRPO keys: their sections and the aliases they are of (checks: agent_trainer.checks.multiturn).

Seed 004 (``config/multiturn_grpo_*.yaml``) spells several settings this project already
has under another name. Each such seed key is an *alias*: null (the default) means "follows
the project's key"; set, it must equal that key, else the run is refused before Ray starts
with one line naming both keys and values. The seed configs make the project's key follow the
alias by interpolation (``agent_proxy.max_turn: ${algorithm.multiturn_grpo.max_turns_per_trajectory}``),
the way ``es_manager.seed`` follows ``trainer.seed``: one value, resolved once by OmegaConf.

``ctx_manager.keep_last_n_turns`` and ``multiturn_trajectory.context_condenser.keep_last_n_steps``
are both null by default: either one sets the other, both set must agree (2 when neither is).
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_KEEP_LAST_N = 2
"""Past steps a recap shows when neither keep_last_n_turns nor keep_last_n_steps is set."""
DEFAULT_EPSILON = 1e-6
"""algorithm.advantage_epsilon's default (the estimators' own default)."""


STEP_VIEWS = ("answer", "reply")
"""context_condenser.step_view: a past step's <answer> text, or its whole reply."""


@dataclass
class ContextCondenserConfig:
    """``multiturn_trajectory.context_condenser``: how each step's context is built."""

    type: str = "simple"
    """full | simple | truncate | summary, or "package.module:ClassName" of your own condenser."""
    keep_last_n_steps: int | None = 2
    """simple / summary: past steps shown (the last n); 0 = none. In the trainer config null (the default) follows
    ctx_manager.keep_last_n_turns (its alias; both set must agree), else 2."""
    max_condensed_tokens: int | None = 1024
    """Budget of every context in tokens of the policy's tokenizer, enforced for every strategy. In the trainer
    config null (the default) = actor_rollout_ref.rollout.max_model_len - response_length (all the room a prompt
    has); a set value must leave response_length tokens for the reply."""
    summary_max_tokens: int = 128
    """summary: tokens the policy may generate for one summary of the older steps."""
    summary_temperature: float = 0.0
    """summary: sampling temperature of the summary call (0 = greedy); seeded like the turns' sampling."""
    step_view: str = "answer"
    """simple / summary: show a past step's <answer> text ("answer", as ctx_manager.mode=condensed does)
    or its whole reply verbatim ("reply")."""

    def __post_init__(self):
        key = "multiturn_trajectory.context_condenser"
        for name, low in (("keep_last_n_steps", 0), ("max_condensed_tokens", 1), ("summary_max_tokens", 1)):
            value = getattr(self, name)
            if value is None and name != "summary_max_tokens":
                continue  # resolved from its alias / the model length by the trainer config
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{key}.{name} = {value!r} must be an int >= {low}")
        if isinstance(self.summary_temperature, bool) or not isinstance(self.summary_temperature, (int, float)) \
                or not 0 <= self.summary_temperature < float("inf"):
            raise ValueError(f"{key}.summary_temperature = {self.summary_temperature!r} must be a number >= 0 "
                             "(0 = greedy)")
        if self.type == "summary" and self.max_condensed_tokens is not None \
                and self.summary_max_tokens >= self.max_condensed_tokens:
            raise ValueError(f"{key}.summary_max_tokens = {self.summary_max_tokens} must be < "
                             f"{key}.max_condensed_tokens = {self.max_condensed_tokens}; lower it")
        if self.step_view not in STEP_VIEWS:
            raise ValueError(f"{key}.step_view = {self.step_view!r} is not one of {list(STEP_VIEWS)}")


@dataclass
class MultiturnGRPOConfig:
    """``algorithm.multiturn_grpo`` (seed 004): aliases of the project's keys; null = follow them."""

    n_trajectories_per_question: int | None = None
    """Trajectories sampled per question (the GRPO group): alias of es_manager.train.group_size."""
    max_turns_per_trajectory: int | None = None
    """Most turns of a trajectory: alias of agent_proxy.max_turn."""
    max_context_length: int | None = None
    """Most tokens of one training row (condensed context + reply): alias of actor_rollout_ref.rollout.max_model_len."""


@dataclass
class GenerationConfig:
    """``multiturn_trajectory.generation`` (seed 004): aliases of actor_rollout_ref.rollout keys; null = follow."""

    max_sequence_length: int | None = None
    """Alias of actor_rollout_ref.rollout.max_model_len."""
    max_new_tokens: int | None = None
    """Tokens one turn may generate: alias of actor_rollout_ref.rollout.response_length."""
    temperature: float | None = None
    """Alias of actor_rollout_ref.rollout.temperature."""
    top_p: float | None = None
    """Alias of actor_rollout_ref.rollout.top_p."""
    top_k: int | None = None
    """Alias of actor_rollout_ref.rollout.top_k."""
    batch_size: int | None = None
    """Trajectories generated per training step; must equal es_manager.train.env_groups x group_size."""


@dataclass
class MultiturnTrajectoryConfig:
    """``multiturn_trajectory``: how each turn's context is built (read with ctx_manager.mode=condensed)."""

    context_condenser: ContextCondenserConfig = field(
        default_factory=lambda: ContextCondenserConfig(keep_last_n_steps=None, max_condensed_tokens=None))
    generation: GenerationConfig = field(default_factory=GenerationConfig)


@dataclass
class TrajectoryProfilingConfig:
    """``trajectory_profiling``: per-step timing and context-length metrics of the multi-turn rollout."""

    enable: bool = False
    """Log profile/* and timing_s/turn_* metrics every step (generation and env-step time per turn; the groups
    below); see docs/multiturn_grpo.md."""
    profile_reward_computation: bool = True
    """With enable: timing_s/reward_computation and profile/reward_* (trajectory reward computers)."""
    profile_context_condensation: bool = True
    """With enable: timing_s/condensation, timing_s/summary_generate, profile/context_tokens_* per turn before and
    after condensation, profile/tokens_saved."""
