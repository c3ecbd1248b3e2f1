"""Env-state manager: runs a shard of episodes (env groups) for the rollout.

A plain class (no Ray import): ``agent_trainer/workers/env_worker.py`` wraps it with
``ray.remote``; tests use it directly.

Semantics (RAGEN's es_manager):

- A split (train or val) has ``env_groups`` groups of ``group_size`` episodes.
  ``env_configs.tags`` / ``env_configs.n_groups`` assign tags to groups in
  order; ``sum(n_groups)`` must equal ``env_groups``.
- Every member of a group starts from the same seed (GRPO-style groups).
- Seeds (``group_seeds``): training group g at reset r gets
  ``base_seed + r * num_groups + g`` (fresh seeds every reset); validation
  group g always gets ``base_seed + VAL_SEED_OFFSET + g``. Training seeds stay
  below ``base_seed + VAL_SEED_OFFSET`` (2**30 seeds, checked), so the two
  ranges never overlap.
- Each turn executes up to ``max_actions_per_turn`` actions (the rollout
  parsed them from ``<answer>a1 || a2</answer>``), capped by the tag's
  ``max_actions_per_traj``; reaching the cap ends the episode. A turn with a
  missing or invalid action adds ``format_penalty`` (once) to its reward and
  to the episode's ``penalty``.
- A turn the tool-calling agent spent on MCP tools (``EnvInput.tool_calls`` without an action) does not step
  the env and has no penalty; the calls are recorded in the turn (``EnvTurn.tool_calls``). A tool server that
  failed (``EnvInput.service_error``) ends the episode as a service failure, as below.
- An exception raised by an environment ends that episode with
  ``info["error"]`` and the ``error`` metric; it never reaches the caller. A
  :class:`~envs.base.ServiceError` (the env's service failed, not the env) also sets
  ``EpisodeState.service_failure``: the rollout leaves the episode out of training.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Mapping

from agent_trainer.config.envs import EnvGroupsConfig
from agent_trainer.config.splits import Split
from envs import BaseEnv, EnvTagConfig, ServiceError, make_env
from envs.registry import normalize_tags

if TYPE_CHECKING:
    from agent_trainer.config import AgentTrainerConfig

VAL_SEED_OFFSET = 2**30
"""Validation seeds start here (relative to the base seed); training seeds stay below it."""


@dataclass
class EpisodeSpec:
    """One episode slot: its id, its group and its tag."""

    env_id: int
    group_id: int
    tag: str


def plan_episodes(split_cfg: EnvGroupsConfig) -> list[EpisodeSpec]:
    """``env_groups x group_size`` episodes; groups get tags in ``n_groups`` order.

    env_id runs 0..N-1 and group_id = env_id // group_size, so shards made of
    whole consecutive groups keep each group on one actor.
    """
    split_cfg.validate()
    group_tags = [tag for tag, n in zip(split_cfg.tags, split_cfg.n_groups) for _ in range(n)]
    return [
        EpisodeSpec(env_id=g * split_cfg.group_size + k, group_id=g, tag=tag)
        for g, tag in enumerate(group_tags)
        for k in range(split_cfg.group_size)
    ]


def group_seeds(split: Split | str, num_groups: int, reset_index: int, base_seed: int) -> list[int]:
    """One seed per group: training seeds advance with reset_index, validation seeds are fixed."""
    if split == Split.VAL:
        return [base_seed + VAL_SEED_OFFSET + g for g in range(num_groups)]
    if split != Split.TRAIN:
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    last = (reset_index + 1) * num_groups
    if reset_index < 0 or last > VAL_SEED_OFFSET:
        raise ValueError(
            f"reset_index {reset_index} x num_groups {num_groups} leaves the training seed range "
            f"[0, {VAL_SEED_OFFSET}); use a different base_seed"
        )
    return [base_seed + reset_index * num_groups + g for g in range(num_groups)]


def held_out_seeds(cfg: AgentTrainerConfig) -> list[int]:
    """The held-out seeds of an RL config's validation split (``es_manager.val``), one per group: the seeds its
    validation rollouts reset with (:func:`group_seeds`), for tools that play the same episodes outside the run."""
    return group_seeds(Split.VAL, cfg.es_manager.val.env_groups, 0, cfg.es_manager.seed)


# --------------------------------------------------------------------------- turn records


@dataclass
class EnvInput:
    """The model's answer for one episode this turn."""

    env_id: int
    llm_response: str
    actions: list[str]
    """Parsed from <answer>...</answer>; empty means missing or unparsable."""
    tool_calls: list[dict] = field(default_factory=list)
    """The agent's calls of MCP tools this turn (``agents.mcp_tools.ToolCallRecord`` as dicts), recorded in the
    turn. A turn with tool calls and no action is a tool turn: the env does not step and charges no penalty."""
    service_error: str | None = None
    """A tool server failed this turn (``agents.mcp_tools``): the episode ends as a service failure, no action runs."""


@dataclass
class EnvOutput:
    """What the rollout needs after a reset or a step."""

    env_id: int
    group_id: int
    tag: str
    observation: str
    instruction: str
    reward: float
    done: bool
    info: dict


@dataclass
class EnvTurn:
    """One turn of an episode as its env actor recorded it (``EpisodeState.history``)."""

    observation: str
    """The observation shown before the turn."""
    llm_response: str
    actions: list[str]
    """The actions executed (parsed from the reply; an invalid one is not executed)."""
    reward: float
    """The turn's reward, the format penalty included."""
    info: dict
    """The env's info of the turn (action_is_valid, action_is_effective, num_actions, truncated, ...)."""
    tool_calls: list[dict] = field(default_factory=list)
    """The MCP tool calls of the turn's reply (``EnvInput.tool_calls``): name, arguments, result or error, latency."""


@dataclass
class EpisodeState:
    """One episode at the end of a rollout, as an env actor returns it (``get_rollout_states``, across Ray)."""

    env_id: int
    group_id: int
    tag: str
    history: list[EnvTurn]
    penalty: float
    """The episode's format penalties, summed (each is already inside its turn's ``reward``; never added again)."""
    final_observation: str
    metrics: dict[str, float]
    """success (final), num_actions, num_turns, the mean of every numeric info key over executed actions,
    error, truncated and pass@group (any member of the group on this actor succeeded)."""
    error: str | None = None
    """The exception text that ended the episode, if one did."""
    service_failure: bool = False
    """The exception was the env's service failing (:class:`~envs.base.ServiceError`: unreachable, connection
    lost, no answer in time): the rollout leaves the episode out of training and counts it."""
    reward: float | None = None
    """The episode's reward as the rollout trained on it (set by the rollout from the training rows,
    ``agent_trainer.rollout.results.assemble``); None on a state straight from an env actor."""
    turn_replies: list[int] | None = None
    """Per ``history`` turn, the number (1-based, a row's ``turn_ids``) of the reply that led to it, 0 for none;
    None: the k-th reply led to the k-th turn (the built-in agents). The gateway rollout sets it from its
    agents' calls, which may be more or fewer than their env steps (the trajectories pair them by it)."""

    @property
    def total_reward(self) -> float:
        """The episode's reward, the one figure every report shows (docs/rewards.md, "One reward figure"): the
        sum of the rewards on its training rows once the rollout set it (``reward``), else the sum of its
        turns' rewards (:func:`episode_reward`); each turn's format penalty is inside its turn, counted once."""
        return float(self.reward) if self.reward is not None else episode_reward(t.reward for t in self.history)


@dataclass
class _Episode:
    """Mutable state of one episode slot (internal)."""

    spec: EpisodeSpec
    env: BaseEnv
    tag_cfg: EnvTagConfig
    observation: str = ""
    done: bool = False
    penalty: float = 0.0
    num_actions: int = 0
    history: list[EnvTurn] = field(default_factory=list)
    action_infos: list = field(default_factory=list)
    last_info: dict = field(default_factory=dict)
    error: str | None = None
    service_failure: bool = False
    truncated: bool = False
    was_reset: bool = False
    """False until the first reset: a restarted actor's episodes must be reset before they step."""


class EnvStateManager:
    """Hosts episodes of any registered environment; steps them turn by turn."""

    def __init__(
        self,
        tags: Mapping[str, EnvTagConfig] | Mapping[str, dict],
        episodes: list[EpisodeSpec],
        format_penalty: float = -0.1,
        action_sep: str = "||",
        max_actions_per_turn: int = 1,
        max_observation_chars: int = 20000,
    ):
        """Create one environment per episode from its tag (errors name the tag)."""
        self.tags = normalize_tags(tags)
        self.max_observation_chars = int(max_observation_chars)
        self.format_penalty = float(format_penalty)
        self.action_sep = action_sep
        self.max_actions_per_turn = int(max_actions_per_turn)
        if self.max_actions_per_turn < 1:
            raise ValueError(f"max_actions_per_turn must be >= 1, got {max_actions_per_turn!r}")
        self.episodes: dict[int, _Episode] = {}
        for spec in episodes:
            spec = spec if isinstance(spec, EpisodeSpec) else EpisodeSpec(**spec)
            if spec.tag not in self.tags:
                raise ValueError(f"episode {spec.env_id}: unknown tag {spec.tag!r}; known tags: {sorted(self.tags)}")
            if spec.env_id in self.episodes:
                raise ValueError(f"duplicate env_id {spec.env_id} in episodes")
            env = make_env(spec.tag, self.tags)
            self.episodes[spec.env_id] = _Episode(spec=spec, env=env, tag_cfg=self.tags[spec.tag])

    # ---------------------------------------------------------------- reset
    def reset(self, seeds: Mapping[int, int]) -> list[EnvOutput]:
        """Reset every episode with its group's seed; returns initial observations."""
        missing = sorted({ep.spec.group_id for ep in self.episodes.values()} - set(seeds))
        if missing:
            raise ValueError(f"reset: no seed for group(s) {missing}; pass seeds={{group_id: seed}} for every group")
        return self._reset({ep.spec.group_id for ep in self.episodes.values()}, seeds)

    def reset_groups(self, seeds: Mapping[int, int]) -> list[EnvOutput]:
        """Reset the episodes of the given groups only (group_id -> seed), the others going on as they are
        (``trainer.refill=group``: a group starts again as soon as it ends); returns their initial observations."""
        unknown = sorted(set(seeds) - {ep.spec.group_id for ep in self.episodes.values()})
        if unknown:
            raise ValueError(f"reset: group(s) {unknown} are not hosted by this env actor")
        return self._reset(set(seeds), seeds)

    def _reset(self, groups: set[int], seeds: Mapping[int, int]) -> list[EnvOutput]:
        outputs = []
        for ep in (ep for ep in self.episodes.values() if ep.spec.group_id in groups):
            ep.done, ep.penalty, ep.num_actions, ep.truncated = False, 0.0, 0, False
            ep.history, ep.action_infos, ep.error, ep.was_reset = [], [], None, True
            ep.service_failure = False
            ep.last_info = {"success": False, "action_is_valid": True, "action_is_effective": False}
            try:
                ep.observation = self._observation(ep.env.reset(seed=int(seeds[ep.spec.group_id])), "reset")
            except Exception as exc:  # a broken env must not take the rollout down
                ep.observation = ""
                self._fail(ep, exc)
            outputs.append(self._output(ep, reward=0.0, info=dict(ep.last_info), instruction=self._instruction(ep)))
        return outputs

    def _instruction(self, ep: _Episode) -> str:
        return episode_instruction(ep.env, ep.tag_cfg, self.max_actions_per_turn, self.action_sep,
                                   self.max_observation_chars)

    # ---------------------------------------------------------------- step
    def step(self, inputs: list[EnvInput]) -> list[EnvOutput]:
        """Execute each input's actions in its episode; returns one output per input."""
        outputs = []
        for inp in inputs:
            inp = inp if isinstance(inp, EnvInput) else EnvInput(**inp)
            if inp.env_id not in self.episodes:
                raise ValueError(f"step: unknown env_id {inp.env_id}; this manager holds {sorted(self.episodes)}")
            if not self.episodes[inp.env_id].was_reset:  # e.g. the actor restarted after its (prefetched) reset
                raise RuntimeError(f"step: episode {inp.env_id} was never reset in this env actor (did it restart "
                                   "after the reset?); its episodes end here and the next rollout resets them")
            outputs.append(self._step_one(self.episodes[inp.env_id], inp))
        return outputs

    def _step_one(self, ep: _Episode, inp: EnvInput) -> EnvOutput:
        obs_before = ep.observation
        actions = [a for a in (inp.actions or []) if isinstance(a, str)]
        if ep.done:  # stepping a finished episode is a no-op
            return self._output(ep, 0.0, dict(ep.last_info, action_is_valid=False, action_is_effective=False))
        tool_calls = list(inp.tool_calls or [])
        if inp.service_error or (tool_calls and not actions):  # a tool server failed, or a turn spent on tools
            info = self._fail(ep, ServiceError(inp.service_error)) if inp.service_error else \
                {"tool_turn": True, "action_is_valid": True, "action_is_effective": False, "num_actions": 0}
            ep.history.append(EnvTurn(observation=obs_before, llm_response=inp.llm_response, actions=[], reward=0.0,
                                      info=dict(info), tool_calls=tool_calls))
            return self._output(ep, 0.0, info)
        budget = ep.tag_cfg.max_actions_per_traj - ep.num_actions
        to_run = actions[: min(self.max_actions_per_turn, budget)]
        reward, executed, infos = 0.0, [], []
        for action in to_run:
            try:
                obs, r, done, info = ep.env.step(action)
                info = dict(info) if isinstance(info, Mapping) else {}
                ep.observation, reward = self._observation(obs, "step"), reward + _reward(r)
            except Exception as exc:
                info = self._fail(ep, exc)
                done = True
            ep.num_actions += 1
            executed.append(action)
            infos.append(info)
            ep.action_infos.append(info)
            ep.last_info = info
            if done:
                ep.done = True
                break
        if not ep.done and ep.num_actions >= ep.tag_cfg.max_actions_per_traj:
            ep.done, ep.truncated = True, True
        turn_valid = bool(actions) and len(actions) == len(inp.actions or []) \
            and all(i.get("action_is_valid", False) for i in infos)
        if not turn_valid:
            reward += self.format_penalty
            ep.penalty += self.format_penalty
        if not infos:  # no action ran (missing answer or no budget): record the turn as invalid
            ep.action_infos.append({"action_is_valid": False, "action_is_effective": False})
        turn_info = dict(ep.last_info)
        turn_info.update(
            action_is_valid=turn_valid,
            action_is_effective=any(i.get("action_is_effective", False) for i in infos),
            num_actions=len(executed),
        )
        if ep.truncated:
            turn_info["truncated"] = True
        ep.history.append(EnvTurn(observation=obs_before, llm_response=inp.llm_response, actions=executed,
                                  reward=reward, info=turn_info, tool_calls=tool_calls))
        return self._output(ep, reward, turn_info)

    def _observation(self, obs, method: str) -> str:
        """An env's observation as safe text of bounded length; a non-str observation raises TypeError."""
        if not isinstance(obs, str):
            raise TypeError(f"{method}() returned an observation of type {type(obs).__name__}; it must be a str")
        return clean_text(obs, self.max_observation_chars)

    def _fail(self, ep: _Episode, exc: BaseException) -> dict:
        """End an episode after an environment exception; return its info."""
        ep.error = clean_text(f"{type(exc).__name__}: {exc}", 2000)
        ep.service_failure = isinstance(exc, ServiceError)
        ep.done = True
        ep.last_info = {"success": False, "action_is_valid": False, "action_is_effective": False,
                        "error": ep.error, "traceback": traceback.format_exc(limit=5)}
        return ep.last_info

    def _output(self, ep: _Episode, reward: float, info: dict, instruction: str = "") -> EnvOutput:
        return EnvOutput(env_id=ep.spec.env_id, group_id=ep.spec.group_id, tag=ep.spec.tag,
                         observation=ep.observation, instruction=instruction, reward=float(reward),
                         done=ep.done, info=info)

    # ---------------------------------------------------------------- results
    def get_rollout_states(self, groups: list[int] | None = None) -> list[EpisodeState]:
        """Per episode: env_id, group_id, tag, history, penalty, final_observation, metrics (:class:`EpisodeState`).

        ``history`` has one :class:`EnvTurn` per turn: the observation shown before the
        turn, llm_response, executed actions, reward (incl. format penalty) and
        info. ``metrics``: success (final), num_actions, num_turns, the mean of
        every numeric info key over executed actions (action_is_valid and
        action_is_effective ratios; turns without an action count as invalid),
        error, truncated and pass@group (any member of the group on this
        manager succeeded). ``groups``: only the episodes of these groups (default every episode).
        """
        group_success: dict[int, bool] = {}
        for ep in self.episodes.values():
            ok = bool(ep.last_info.get("success", False))
            group_success[ep.spec.group_id] = group_success.get(ep.spec.group_id, False) or ok
        states = []
        for ep in self.episodes.values():
            if groups is not None and ep.spec.group_id not in groups:
                continue
            metrics = _mean_info(ep.action_infos)
            metrics.update(
                success=float(bool(ep.last_info.get("success", False))),
                num_actions=float(ep.num_actions),
                num_turns=float(len(ep.history)),
                error=float(ep.error is not None),
                service_failure=float(ep.service_failure),
                truncated=float(ep.truncated),
            )
            metrics["pass@group"] = float(group_success[ep.spec.group_id])
            states.append(EpisodeState(env_id=ep.spec.env_id, group_id=ep.spec.group_id, tag=ep.spec.tag,
                                       history=list(ep.history), penalty=ep.penalty,
                                       final_observation=ep.observation, metrics=metrics, error=ep.error,
                                       service_failure=ep.service_failure))
        return states

    def close(self) -> None:
        """Close every environment."""
        for ep in self.episodes.values():
            try:
                ep.env.close()
            except Exception:  # closing is best effort
                pass


def episode_instruction(env: BaseEnv, tag_cfg: EnvTagConfig, max_actions_per_turn: int = 1, action_sep: str = "||",
                        max_chars: int = 20000) -> str:
    """The instruction an episode of ``env`` starts with: the tag's ``env_instruction``, the env's legend, its valid
    actions and how many to give per turn (``es_manager.max_actions_per_turn``, ``action_sep``)."""
    parts = [tag_cfg.env_instruction.strip()]
    try:
        legend, actions = env.legend(), env.action_description()
    except Exception as exc:
        legend, actions = "", f"(unavailable: {exc})"
    if legend:
        parts.append(clean_text(str(legend), max_chars))
    parts.append(f"Valid actions: {clean_text(str(actions), max_chars)}")
    if max_actions_per_turn > 1:
        parts.append(f"You may give up to {max_actions_per_turn} actions per turn, separated by '{action_sep}'.")
    else:
        parts.append("Give exactly one action per turn.")
    return "\n".join(p for p in parts if p)


def episode_reward(turn_rewards: Iterable[float]) -> float:
    """An episode's reward: the sum of its turns' rewards, each of which holds the turn's format penalty (once)."""
    return float(sum(float(r) for r in turn_rewards))


def safe_text(text: str) -> str:
    """``text`` with lone surrogates replaced by U+FFFD and NUL bytes removed (tokenizers choke on both)."""
    return text.encode("utf-8", "surrogatepass").decode("utf-8", "replace").replace("\x00", "")


def clean_text(text: str, max_chars: int) -> str:
    """Untrusted text made safe to tokenize: lone surrogates become U+FFFD, NUL bytes are removed, and
    text longer than ``max_chars`` is cut, ending in a marker naming how many characters were dropped."""
    text = safe_text(text)
    if len(text) <= max_chars:
        return text
    marker = f"\n[... {len(text) - max_chars} more characters cut (es_manager.max_observation_chars)]"
    return text[:max_chars] + marker


def _reward(value) -> float:
    """An env's reward as a float; a str or other non-number raises TypeError (NaN passes: the
    rollout screens non-finite rewards per ``algorithm.nonfinite_reward``)."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__float__"):
        raise TypeError(f"step() returned a reward of type {type(value).__name__}; it must be a number")
    return float(value)


def _mean_info(infos: list[dict]) -> dict[str, float]:
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for info in infos:
        for key, value in info.items():
            if isinstance(value, (bool, int, float)):
                sums[key] = sums.get(key, 0.0) + float(value)
                counts[key] = counts.get(key, 0) + 1
    out = {key: sums[key] / counts[key] for key in sums}
    out.setdefault("action_is_valid", 0.0)
    out.setdefault("action_is_effective", 0.0)
    return out


def summarize_rollout_states(states: list[EpisodeState]) -> dict[str, float]:
    """Aggregate rollout states (from all env actors) into ``env/<tag>/<metric>`` means.

    ``pass@group`` here is recomputed over all states, so it is correct even
    when a group's episodes were spread over several managers.
    """
    by_tag: dict[str, list[EpisodeState]] = {}
    for st in states:
        by_tag.setdefault(st.tag, []).append(st)
    out: dict[str, float] = {}
    for tag, sts in by_tag.items():
        keys = sorted({k for st in sts for k in st.metrics} - {"pass@group"})
        for key in keys:
            vals = [st.metrics[key] for st in sts if key in st.metrics]
            out[f"env/{tag}/{key}"] = sum(vals) / len(vals)
        groups: dict[int, bool] = {}
        for st in sts:
            groups[st.group_id] = groups.get(st.group_id, False) or st.metrics["success"] > 0
        out[f"env/{tag}/pass@group"] = sum(groups.values()) / len(groups)
        out[f"env/{tag}/penalty"] = sum(st.penalty for st in sts) / len(sts)
    return out
