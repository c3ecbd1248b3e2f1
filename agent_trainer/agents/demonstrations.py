"""Expert demonstrations in exactly the prompt format of the RL rollout, and their SFT tokens.

An expert episode is played through the same :class:`EnvStateManager` and the same
:class:`ContextManager` the RL rollout uses (``agent_trainer.rollout.turns.TurnLoop.play``): the
expert's action (``envs`` ``expert_action``, backed by ``envs/experts.py``) becomes the
reply text ``<think>...</think><answer>Action</answer>``, tokenized as the engine's output
would be appended (the text's ids, then eos), so the sequence and its ``response_mask``
are those of an RL episode whose policy happened to answer like the expert.

``noise`` makes a warm start deliberately imperfect: each turn, with that probability
(seeded per episode), the action is a uniformly random valid action instead (or one of
``noise_actions``; noise 1.0 with a subset is a format-only warm start). A ``demonstrator``
other than the expert is a scripted policy ``function(env, rng) -> action`` named by import path.

A demonstration is stored as chat messages (one JSONL record per episode)::

    {"tag": "FrozenLake3x3", "seed": 3, "success": true, "reward": 1.0, "actions": ["Down", ...],
     "expert": [true, ...], "messages": [{"role": "system", "content": ...},
     {"role": "user", "content": ...}, {"role": "assistant", "content": "<think>..</think><answer>Down</answer>"}, ...]}

:func:`encode_conversation` turns any such conversation back into token ids and the
SFT loss mask by the RL rules: the first prompt (system + first user message + assistant
header) and every later user turn (the ids the chat template puts between an eos and the
next assistant header) have mask 0; each assistant reply is its text's ids plus eos, mask 1.
:func:`play_demonstrations` checks, for every episode it plays, that this gives the
ContextManager's own ids and mask, so the two cannot drift apart.

JSONL files are untrusted data: parsed with ``json.loads`` only, every field type-checked.
"""

from __future__ import annotations

import importlib
import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from agent_trainer.common import prompts
from agent_trainer.agents.ctx_manager import ContextManager, EpisodeContext, as_ids
from agent_trainer.episode.es_manager import EnvInput, EnvOutput, EnvStateManager, EpisodeSpec
from envs import BaseEnv, make_env

THINK_TEXT = "The best move now is {action}."
"""The think text of a demonstration reply (short: a tiny model must generate every token of it)."""
ROLES = ("system", "user", "assistant")


@dataclass
class DemoEpisode:
    """Which episode to demonstrate: an env tag and the seed its env is reset with."""

    tag: str
    seed: int


@dataclass
class Demonstration:
    """One played expert episode: its chat messages and the RL token layout."""

    tag: str
    seed: int
    messages: list[dict[str, str]]
    """system, user (instruction + first observation), then assistant / user alternating; ends with assistant
    (or with the last observation when the episode was cut by max_turn)."""
    actions: list[str]
    """The action of each turn's answer."""
    expert: list[bool]
    """Per turn: True when the action was the demonstrator's (the expert's by default), False when ``noise`` replaced it."""
    success: bool
    reward: float
    """The episode's total reward (env rewards and format penalties)."""
    token_ids: list[int] = field(default_factory=list, repr=False)
    """The ContextManager's sequence of the episode (what an RL rollout would train on)."""
    response_mask: list[int] = field(default_factory=list, repr=False)
    """1 exactly on the reply tokens (each reply's ids and its eos)."""

    def record(self) -> dict:
        """The JSONL record (token ids are tokenizer-specific and left out)."""
        out = asdict(self)
        del out["token_ids"], out["response_mask"]
        return out


def reply_text(action: str, think: str | None = None) -> str:
    """The demonstration reply for ``action``: ``<think>..</think><answer>action</answer>`` (``think``: the think
    text a demonstrator chose, default :data:`THINK_TEXT`)."""
    return f"<think>{THINK_TEXT.format(action=action) if think is None else think}</think><answer>{action}</answer>"


def reply_ids(tokenizer, text: str) -> list[int]:
    """The ids an engine returns when it generates ``text`` and stops: the text's ids, then eos."""
    return list(tokenizer.encode(text, add_special_tokens=False)) + [tokenizer.eos_token_id]


def note_text(env: BaseEnv) -> str:
    """What a noting reply thinks (``data.think=note``): the env's ``note()`` when it has one, else the observation
    the reply answers (``render()``), on one line."""
    note = env.note()
    return " ".join((note if note is not None else env.render()).split())


def has_expert(env: BaseEnv) -> bool:
    """Whether the environment overrides ``BaseEnv.expert_action`` (has an expert solver)."""
    return type(env).expert_action is not BaseEnv.expert_action


Demonstrator = Callable[[BaseEnv, random.Random], "str | tuple[str, str]"]
"""A scripted policy: the env (after reset or step) and the episode's seeded RNG -> the action to take, or
(action, think text) when the demonstrator also says what its reply thinks (default :data:`THINK_TEXT`)."""


def resolve_demonstrator(name: str) -> Demonstrator | None:
    """``data.demonstrator``: None for "expert" (each env's ``expert_action``), else the function at
    "package.module:function". Raises ValueError naming the key, the value and the fix."""
    if name == "expert":
        return None
    module_name, _, attr = str(name).partition(":")
    fix = "give expert or an import path 'package.module:function', e.g. envs.frozen_lake:step_into_holes"
    if not module_name or not attr:
        raise ValueError(f"data.demonstrator = {name!r} is neither expert nor an import path; {fix}")
    try:
        function = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"data.demonstrator = {name!r} could not be imported ({exc}); {fix}") from None
    if not callable(function):
        raise ValueError(f"data.demonstrator = {name!r} is not callable; {fix}")
    return function


def valid_actions(env: BaseEnv) -> list[str]:
    """The actions an env lists in ``action_description`` ("Left | Down | ..."); [] when it describes them in prose."""
    description = env.action_description()
    return [a.strip() for a in description.split("|") if a.strip()] if "|" in description else []


def check_demo_tags(tags: list[str], env_tags: Mapping, *, expert: bool = True,
                    noise_actions: list[str] | tuple = ()) -> None:
    """Raise ValueError naming a tag that is unknown, cannot be built, whose environment has no expert solver
    (when the expert demonstrates), or whose valid actions lack one of ``noise_actions``."""
    for tag in tags:
        if tag not in env_tags:
            raise ValueError(f"demonstration tag {tag!r} is not an env tag; known tags: {sorted(env_tags)}")
        try:
            env = make_env(tag, env_tags)
        except Exception as err:  # noqa: BLE001 - a missing optional package or data set
            raise ValueError(f"demonstration tag {tag!r} cannot be built: {' '.join(str(err).split())[:300]}") from None
        try:
            if expert and not has_expert(env):
                raise ValueError(f"demonstration tag {tag!r} ({type(env).__name__}) has no expert solver "
                                 "(expert_action); use a FrozenLake or Sokoban tag")
            if noise_actions:  # reset only to read the action list: an env's reset may be costly (a web shop)
                env.reset(seed=0)
                actions = valid_actions(env)  # [] for prose ("a whole number from 1 to 10"): the user's list stands
                unknown = [a for a in noise_actions if a not in actions] if actions else []
                if unknown:
                    raise ValueError(f"data.noise_actions = {list(noise_actions)}: {unknown} not among tag {tag!r}'s "
                                     f"actions {actions}; e.g. data.noise_actions={actions[:2]}")
        finally:
            env.close()


def play_demonstrations(ctx_mgr: ContextManager, env_tags: Mapping, episodes: list[DemoEpisode], *,
                        max_turn: int, turn_budget: Mapping[str, int], noise: float = 0.0, noise_seed: int = 0,
                        format_penalty: float = -0.1, max_actions_per_turn: int = 1,
                        noise_actions: list[str] | tuple = (), demonstrator: Demonstrator | None = None,
                        think: str = "plain") -> list[Demonstration]:
    """Play ``episodes`` with the expert, turn by turn, exactly like the RL rollout's loop.

    ``turn_budget[tag]`` is the most tokens one turn may generate in RL
    (``min(max_tokens, response_length)``); a demonstration reply longer than that could
    never be generated by the policy, so it raises. ``noise`` in [0, 1]: the probability
    that a turn's action is a random valid action (seeded by ``noise_seed``, tag and seed), drawn from
    ``noise_actions`` when given. ``demonstrator`` (default: each env's expert) picks the other turns' actions.
    ``think="note"``: each reply thinks :func:`note_text` of the observation it answers (unless the demonstrator
    says its own think).
    """
    if not 0.0 <= noise <= 1.0:
        raise ValueError(f"noise = {noise!r} must lie in [0, 1] (the fraction of turns with a random action)")
    specs = [EpisodeSpec(env_id=i, group_id=i, tag=e.tag) for i, e in enumerate(episodes)]
    manager = EnvStateManager(env_tags, specs, format_penalty=format_penalty, action_sep=ctx_mgr.action_sep,
                              max_actions_per_turn=max_actions_per_turn)
    try:
        outputs = manager.reset({i: e.seed for i, e in enumerate(episodes)})
        demos = [_Playing(ctx_mgr.start(out), episodes[out.env_id],
                          random.Random(f"{noise_seed}/{episodes[out.env_id].tag}/{episodes[out.env_id].seed}"),
                          [{"role": "system", "content": prompts.SYSTEM_PROMPT},
                           {"role": "user", "content": prompts.first_user_message(
                               out.instruction, out.observation, ctx_mgr.enable_think)}])
                 for out in outputs]
        for _ in range(max_turn):
            active = [d for d in demos if not d.ctx.done]
            if not active:
                break
            inputs = [_expert_turn(ctx_mgr, manager, d, noise, turn_budget[d.spec.tag], noise_actions, demonstrator,
                                   think) for d in active]
            for out in manager.step(inputs):
                _after_step(ctx_mgr, demos[out.env_id], out, turn_budget[out.tag])
        return [_finish(ctx_mgr, d) for d in demos]
    finally:
        manager.close()


@dataclass
class _Playing:
    """An episode being played: its context, what it was asked for, its noise RNG and its messages."""

    ctx: EpisodeContext
    spec: DemoEpisode
    rng: random.Random
    messages: list[dict[str, str]]
    actions: list[str] = field(default_factory=list)
    expert: list[bool] = field(default_factory=list)
    success: bool = False


def _expert_turn(ctx_mgr: ContextManager, manager: EnvStateManager, demo: _Playing, noise: float,
                 budget: int, noise_actions: list[str] | tuple = (), demonstrator: Demonstrator | None = None,
                 think_mode: str = "plain") -> EnvInput:
    """Pick the turn's action (the demonstrator's, or random with probability ``noise``) and append its reply."""
    env = manager.episodes[demo.ctx.env_id].env
    valid = list(noise_actions) or valid_actions(env)
    if noise > 0 and not valid:
        raise ValueError(f"data.noise = {noise} needs a list of valid actions to draw from, but {demo.spec.tag} "
                         f"describes its actions in prose ({env.action_description()[:80]!r}); list the random "
                         "actions in data.noise_actions (e.g. data.noise_actions=[1,2,3]) or use noise 0 for this tag")
    action, think, from_expert = None, None, False
    if demo.rng.random() >= noise:
        try:
            action = env.expert_action() if demonstrator is None else demonstrator(env, demo.rng)
            from_expert = True
        except RuntimeError:  # no solution from here (e.g. a noisy push stuck a Sokoban box): act randomly
            action = None
    if isinstance(action, tuple):
        action, think = action
    if action is None:
        action = demo.rng.choice(valid)
    if think is None and think_mode == "note":
        think = note_text(env)  # before the step: the observation this reply answers
    text = reply_text(action, think)
    ids = reply_ids(ctx_mgr.tokenizer, text)
    if len(ids) > budget:
        raise ValueError(f"the demonstration reply {text!r} has {len(ids)} tokens but a {demo.spec.tag} turn may "
                         f"generate at most {budget} (min(max_tokens, actor_rollout_ref.rollout.response_length)); "
                         "raise response_length")
    demo.actions.append(action)
    demo.expert.append(from_expert)
    demo.messages.append({"role": "assistant", "content": text})
    return ctx_mgr.append_reply(demo.ctx, ids, [0.0] * len(ids))


def _after_step(ctx_mgr: ContextManager, demo: _Playing, out: EnvOutput, budget: int) -> None:
    """Reward on the reply, next observation appended (as the rollout does); the user message recorded."""
    ctx_mgr.append_env_output(demo.ctx, out, budget)
    demo.success = bool(out.info.get("success", False))
    if not demo.ctx.done:
        demo.messages.append({"role": "user", "content": prompts.next_user_message(
            out.observation, out.reward, ctx_mgr.enable_think)})


def _finish(ctx_mgr: ContextManager, demo: _Playing) -> Demonstration:
    """The demonstration, after checking that its messages encode to the ContextManager's own ids and mask."""
    ids, mask = encode_conversation(ctx_mgr, demo.messages)
    if ids != demo.ctx.token_ids or mask != demo.ctx.response_mask:
        raise RuntimeError(f"{demo.spec}: the SFT encoding of the demonstration differs from the rollout's token "
                           "layout; agent_trainer.agents.demonstrations.encode_conversation must follow ctx_manager.py")
    return Demonstration(tag=demo.spec.tag, seed=demo.spec.seed, messages=demo.messages, actions=demo.actions,
                         expert=demo.expert, success=demo.success, reward=demo.ctx.total_reward,
                         token_ids=list(demo.ctx.token_ids), response_mask=list(demo.ctx.response_mask))


# --------------------------------------------------------------------------- SFT tokens


def encode_conversation(ctx_mgr: ContextManager, messages: list[Mapping[str, str]]) -> tuple[list[int], list[int]]:
    """Token ids and SFT loss mask of a conversation, laid out as the RL rollout lays out an episode.

    ``messages``: an optional system message, a user message, then assistant and user
    messages alternating (checked by :func:`check_messages`). The first prompt is the chat
    template of the messages up to the first user message with the assistant header (mask
    0); an assistant message is its text's ids and eos (mask 1); a later user message is
    the ids between the eos and the next assistant header (mask 0), found as the
    ContextManager finds them.
    """
    check_messages(messages)
    first_user = 1 if messages[0]["role"] == "system" else 0
    head = [{"role": m["role"], "content": m["content"]} for m in messages[: first_user + 1]]
    ids = as_ids(ctx_mgr.tokenizer.apply_chat_template(head, add_generation_prompt=True, tokenize=True))
    mask = [0] * len(ids)
    for message in messages[first_user + 1:]:
        if message["role"] == "assistant":
            part, generated = reply_ids(ctx_mgr.tokenizer, message["content"]), 1
        else:
            part, generated = ctx_mgr._observation_ids(message["content"]), 0  # noqa: SLF001 - the rollout's own code
        ids += part
        mask += [generated] * len(part)
    return ids, mask


def check_messages(messages, where: str = "conversation") -> None:
    """Raise ValueError unless ``messages`` is [system] user (assistant user)* assistant [user], all strings.

    A final user message is allowed: an RL episode cut by ``max_turn`` ends with the
    observation after its last reply (mask 0, no loss on it).
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    for k, m in enumerate(messages):
        if not isinstance(m, Mapping) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: message {k} must be {{'role': one of {list(ROLES)}, 'content': a string}}, "
                             f"got {str(m)[:120]!r}")
    roles = [m["role"] for m in messages]
    body = roles[1:] if roles[0] == "system" else roles
    expected = ["user" if k % 2 == 0 else "assistant" for k in range(len(body))]
    if body != expected or len(body) < 2:
        raise ValueError(f"{where}: roles {roles} must be an optional system message, then user and assistant "
                         "alternating, starting with user, with at least one assistant message")


def write_jsonl(demos: list[Demonstration], path: str | Path) -> Path:
    """Write one JSON record per demonstration (:meth:`Demonstration.record`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for demo in demos:
            f.write(json.dumps(demo.record()) + "\n")
    return path


def read_jsonl(path: str | Path) -> list[list[dict[str, str]]]:
    """The conversations (``messages``) of a JSONL file; each record is checked, errors name the line."""
    conversations = []
    with Path(path).open() as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not a JSON object ({err.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: each line must be a JSON object with a 'messages' list")
            check_messages(record.get("messages"), where)
            conversations.append([{"role": m["role"], "content": m["content"]} for m in record["messages"]])
    if not conversations:
        raise ValueError(f"{path}: no conversations in the file")
    return conversations
