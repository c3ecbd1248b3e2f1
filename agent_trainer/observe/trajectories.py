"""Sampled episodes as JSONL, for the trajectory viewer (``agent_trainer.observe.viewer``).

Every ``trainer.log_trajectories_freq`` steps, up to ``trainer.log_trajectories_per_tag``
episodes per env tag (successes and failures, half each when both exist) are written to
``<run dir>/trajectories/step_<N>.jsonl``, one :class:`EpisodeRecord` per line, and
``viewer.html`` next to them is regenerated.

A turn joins two sources: the training rows' tokens and the env actor's history (observation,
reply text, parsed actions, reward). A row reads as alternating spans, mask 0 (prompt or
observation) then mask 1 (a reply the engine generated), whatever the context layout (one row
per episode, or one per turn); each reply is a turn, numbered by its ``turn_ids`` (its call, for
a gateway agent), and the env step it led to is shown beside it (``EpisodeState.turn_replies``;
for the built-in agents the k-th reply led to the k-th step). A gateway agent that asks again
before acting has turns without a step; a step no reply led to is a turn without tokens.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from agent_trainer.common.batch import TensorBatch
from agent_trainer.config.splits import Split
from agent_trainer.episode.es_manager import EpisodeState
from agent_trainer.trajectory_rewards.judge import JudgeVerdict
from agent_trainer.observe.viewer import write_viewer


@dataclass
class TurnRecord:
    """One turn: what the model saw, what it generated, what the env made of it."""

    turn: int
    observation: str
    """The environment's observation before the turn (a grid for grid envs)."""
    prompt: str
    """Decoded mask-0 tokens before the reply: the first prompt, or the text appended after the last reply."""
    reply: str
    """The reply text the env actor parsed."""
    actions: list[str]
    """Actions parsed from the reply and executed."""
    reward: float
    done: bool
    token_ids: list[int] = field(default_factory=list)
    """The prompt span's ids, then the reply's (one list)."""
    tokens: list[str] = field(default_factory=list)
    """Each id decoded on its own."""
    mask: list[int] = field(default_factory=list)
    """response_mask of each token: 1 exactly on the generated reply."""
    advantage: list[float] = field(default_factory=list)
    """The advantage of each token (0 off the mask); empty when the row was filtered out before training."""
    call: int = 0
    """The reply's number (1-based; a gateway agent's chat completion); 0: an env step without a reply of its own."""
    step: int = 0
    """The env step's number (1-based); 0: a reply that led to no env step (a gateway agent that asked again)."""
    tool_calls: list[dict] = field(default_factory=list)
    """The reply's MCP tool calls (``EnvTurn.tool_calls``): server, name, arguments, result or error, latency_s,
    service_failure."""


@dataclass
class EpisodeRecord:
    """One episode of one step, as the viewer shows it."""

    step: int
    split: str
    """A rollout's :class:`Split` (its text), or an evaluation pass's label (``val_greedy``, ``val_pass@k``)."""
    tag: str
    env_id: int
    group_id: int
    success: bool
    total_reward: float
    """The episode's reward (``EpisodeState.total_reward``): the figure of the metrics and the eval report;
    its turns' rewards sum to it (each turn's format penalty counted once, in its turn)."""
    final_observation: str
    turns: list[TurnRecord]
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    """The episode's own metrics (``EpisodeState.metrics``: success, num_turns, ...; a gateway episode's
    ``gateway_rows`` and ``gateway_breaks``)."""
    judge: JudgeVerdict | None = None
    """With ``judge.enable``: the judge's call (its messages, its reply) and score, or why it left the episode
    unscored; ``total_reward`` stays the environment's part."""
    group_seed: int | None = None
    """The seed the episode's group was reset with (``batch.meta.group_seeds``): with ``env_id``, the episode's
    identity across steps (``env_id`` slots are reused by every rollout)."""

    @classmethod
    def from_json(cls, line: str) -> EpisodeRecord:
        """Parse one JSONL line."""
        data = json.loads(line)
        data["turns"] = [TurnRecord(**t) for t in data["turns"]]  # older files: no call, step or metrics
        if data.get("judge") is not None:
            data["judge"] = JudgeVerdict(**data["judge"])
        return cls(**data)


def sample_states(states: list[EpisodeState], per_tag: int) -> list[EpisodeState]:
    """Up to ``per_tag`` episodes per tag in env_id order: half successes, half failures (the rest when one side is short)."""
    chosen: list[EpisodeState] = []
    for tag in sorted({s.tag for s in states}):
        of_tag = sorted((s for s in states if s.tag == tag), key=lambda s: s.env_id)
        wins = [s for s in of_tag if s.metrics.get("success", 0.0) > 0]
        losses = [s for s in of_tag if s not in wins]
        n_win = min(len(wins), max(per_tag - len(losses), per_tag // 2 + per_tag % 2))
        n_win = min(n_win, per_tag)
        chosen += wins[:n_win] + losses[:per_tag - n_win]
    return chosen


def row_spans(mask: list[int]) -> list[tuple[range, range]]:
    """Split a row's mask into (mask-0 span, following mask-1 span) pairs; a trailing mask-0 span gets an empty reply."""
    spans, start, n = [], 0, len(mask)
    while start < n:
        mid = start
        while mid < n and mask[mid] == 0:
            mid += 1
        end = mid
        while end < n and mask[end] == 1:
            end += 1
        spans.append((range(start, mid), range(mid, end)))
        start = end
    return spans


def reply_spans(rows: list[dict]) -> list[tuple[int, dict, range, range]]:
    """Every reply of an episode's rows as (its number, row, the mask-0 span before it, its mask-1 span), ordered
    by number: a reply's ``turn_ids`` (a row's ``turn``), or its place in the rows when they carry none."""
    spans = [(row, prompt, reply) for row in rows for prompt, reply in row_spans(row["mask"]) if len(reply)]
    numbers = [row["turn"][reply.start] if row.get("turn") else 0 for row, _, reply in spans]
    if not all(numbers):
        numbers = list(range(1, len(spans) + 1))
    return sorted(((n, *span) for n, span in zip(numbers, spans)), key=lambda s: s[0])


def episode_record(state: EpisodeState, rows: list[dict], tokenizer, step: int, split: str,
                   judge: JudgeVerdict | None = None) -> EpisodeRecord:
    """Join one episode's env history with its training rows (``rows``: ids, mask, advantage, turn lists, in
    order): a turn per reply, beside the env step it led to (module docstring), and the judge's verdict on it, if
    any."""
    history = state.history
    led_to = state.turn_replies if state.turn_replies is not None and len(state.turn_replies) == len(history) \
        else list(range(1, len(history) + 1))
    steps_of: dict[int, list[int]] = defaultdict(list)
    for k, number in enumerate(led_to):
        steps_of[number].append(k)
    replies_of: dict[int, list[tuple]] = defaultdict(list)
    for number, row, prompt, reply in reply_spans(rows):
        replies_of[number].append((row, prompt, reply))
    turns = []
    for number in sorted(set(steps_of) | set(replies_of)):
        replies, steps = replies_of.get(number, []), steps_of.get(number, [])
        for i in range(max(len(replies), len(steps))):
            k = steps[i] if i < len(steps) else None
            record = _turn(state, led_to, k, number if i < len(replies) else 0)
            if i < len(replies):
                _add_tokens(record, *replies[i], tokenizer)
                if k is None:
                    record.reply = tokenizer.decode(record.token_ids[len(replies[i][1]):], skip_special_tokens=True)
            record.turn = len(turns) + 1
            turns.append(record)
    metrics = {k: float(v) for k, v in state.metrics.items() if isinstance(v, (bool, int, float))}
    return EpisodeRecord(step=step, split=split, tag=state.tag, env_id=int(state.env_id),
                         group_id=int(state.group_id), success=bool(state.metrics.get("success", 0.0) > 0),
                         total_reward=state.total_reward,
                         final_observation=str(state.final_observation), turns=turns, error=state.error,
                         metrics=metrics, judge=judge)


def _turn(state: EpisodeState, led_to: list[int], k: int | None, call: int) -> TurnRecord:
    """The turn of env step ``k`` (None: a reply that led to no step, shown with the observation the agent had)."""
    history = state.history
    if k is None:
        after = [j for j, n in enumerate(led_to) if n > call]
        seen = history[after[0]].observation if after else state.final_observation
        return TurnRecord(turn=0, observation=str(seen), prompt="", reply="", actions=[], reward=0.0, done=False,
                          call=call)
    turn = history[k]
    return TurnRecord(turn=0, observation=str(turn.observation), prompt="", reply=str(turn.llm_response),
                      actions=[str(a) for a in turn.actions], reward=float(turn.reward), done=k == len(history) - 1,
                      call=call, step=k + 1, tool_calls=[dict(c) for c in getattr(turn, "tool_calls", [])])


def _add_tokens(record: TurnRecord, row: dict, prompt: range, reply: range, tokenizer) -> None:
    idx = list(prompt) + list(reply)
    record.token_ids = [row["ids"][i] for i in idx]
    record.tokens = tokenizer.batch_decode([[i] for i in record.token_ids])
    record.mask = [row["mask"][i] for i in idx]
    record.advantage = [round(row["adv"][i], 4) for i in idx] if row["adv"] else []
    record.prompt = tokenizer.decode([row["ids"][i] for i in prompt])


def rows_by_episode(batch: TensorBatch, fallback: TensorBatch | None = None) -> dict[int, list[dict]]:
    """Per ``traj_uid``: its rows' real tokens (ids, mask, advantage, turn ids), in batch order.

    Episodes missing from ``batch`` (filtered out by rollout shaping) are taken from
    ``fallback`` (the rollout's batch) with no advantages.
    """
    out: dict[int, list[dict]] = {}
    for source, with_adv in ((batch, True), (fallback, False)):
        if source is None:
            continue
        seen = set(out)
        adv = source["advantages"] if with_adv and "advantages" in source else None
        turn = source["turn_ids"] if "turn_ids" in source else None
        for b in range(len(source)):
            uid = int(source["traj_uid"][b])
            if uid in seen:
                continue
            n = int(source["attention_mask"][b].sum())
            out.setdefault(uid, []).append({
                "ids": source["input_ids"][b, :n].tolist(), "mask": source["response_mask"][b, :n].tolist(),
                "adv": adv[b, :n].tolist() if adv is not None else [],
                "turn": turn[b, :n].tolist() if turn is not None else [],
            })
    return out


def write_step(run_dir: str | Path, step: int, split: str, states: list[EpisodeState], batch: TensorBatch, tokenizer,
               per_tag: int, fallback: TensorBatch | None = None,
               judge: dict[int, JudgeVerdict] | None = None) -> Path:
    """Write a sample of the step's episodes to ``trajectories/step_<N>.jsonl`` and regenerate the viewer
    (``judge``: the judge's verdicts by env id, ``RolloutResult.judge``)."""
    folder = Path(run_dir) / "trajectories"
    folder.mkdir(parents=True, exist_ok=True)
    rows, judge = rows_by_episode(batch, fallback), judge or {}
    seeds = list(batch.meta.group_seeds or (fallback.meta.group_seeds if fallback is not None else []))
    records = [dataclasses.replace(episode_record(s, rows.get(int(s.env_id), []), tokenizer, step, split,
                                                  judge.get(int(s.env_id))),
                                   group_seed=seeds[s.group_id] if s.group_id < len(seeds) else None)
               for s in sample_states(states, per_tag)]
    path = folder / (f"step_{step}.jsonl" if split == Split.TRAIN else f"{split}_step_{step}.jsonl")
    path.write_text("".join(json.dumps(dataclasses.asdict(r)) + "\n" for r in records))
    write_viewer(folder, read_records(folder))
    return path


def read_records(folder: str | Path) -> list[EpisodeRecord]:
    """Every record of every ``*.jsonl`` file in ``folder``, by step."""
    records = []
    for path in sorted(Path(folder).glob("*.jsonl")):
        records += [EpisodeRecord.from_json(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(records, key=lambda r: (r.step, r.split, r.tag, r.env_id))
