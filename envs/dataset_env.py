"""A prompt dataset played as environment episodes: single-turn training and a question environment.

Each episode serves one dataset row: the row is chosen by the episode's seed (the seed is the
dataset position, so the env seed counter the checkpoints save is the dataset position;
each epoch is a seeded shuffle, ``envs.datasets.row_for_position``). The observation
is the row's prompt; the answer (the text inside ``<answer>``) is scored by the reward
function (``envs.reward_fns``) against the row's ground truth.

- ``max_turns: 1`` (single-turn): the first answer is final and scored; the episode ends.
- ``max_turns > 1`` (the question environment): each turn is a reasoning step. An answer
  that contains ``final_marker`` (e.g. ``Final answer: 42``) is final and the text after the
  marker is scored; any other answer is a step, recorded and shown back, with reward 0. The
  answer of turn ``max_turns`` is final whatever it says.

Every step's info names the row (``question_id``) and carries its ``ground_truth``, so the
multi-turn GRPO trajectory reward computers (``reward_computation``, docs/multiturn_grpo.md)
can check the trajectory's final answer, e.g. run a coding row's tests.

The training tags are built from the ``data.*`` config section (``agent_trainer.episode.prompt_data``
docs, docs/rewards.md); the env can also be used directly in an env tag with ``env_type:
prompt_dataset``. Like every env it imports neither Ray, torch nor a tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from envs.datasets import PromptRecord, load_prompts, row_for_position
from envs.reward_fns import load_reward_fn, score
from envs.base import BaseEnv, make_info

MAX_ANSWER_CHARS = 4000


@dataclass
class PromptDatasetConfig:
    """Options of the prompt-dataset environment."""

    files: list = field(default_factory=list)
    """Data files (JSON, JSONL, TXT, parquet) or RAGEN split folders; rows are concatenated in order."""
    prompt_key: str = "prompt"
    """Field holding the prompt: text or chat messages."""
    ground_truth_key: str = "reward_model.ground_truth"
    """Dotted path of the ground truth in a row."""
    shuffle: bool = True
    """Walk each epoch in a seeded random order (else file order)."""
    shuffle_seed: int = 0
    """Seed of the shuffles."""
    reward_fn_path: str = ""
    """Python file of the reward function ("" = the default math scorer)."""
    reward_fn_name: str = "compute_score"
    """The reward function's name in that file."""
    max_turns: int = 1
    """Turns per question: 1 = single-turn; more = reasoning steps until a final answer."""
    final_marker: str = "Final answer:"
    """With max_turns > 1: the text that marks an answer as final (case-insensitive)."""

    def __post_init__(self):
        if isinstance(self.max_turns, bool) or not isinstance(self.max_turns, int) or self.max_turns < 1:
            raise ValueError(f"max_turns must be a positive int, got {self.max_turns!r}")
        if self.max_turns > 1 and not self.final_marker.strip():
            raise ValueError("final_marker must be non-empty when max_turns > 1 (it tells steps from answers)")
        if not self.files:
            raise ValueError("files is empty; list the data files (data.train_files / data.val_files)")


class PromptDatasetEnv(BaseEnv):
    """One dataset row per episode; the answer is scored by a reward function."""

    config_cls = PromptDatasetConfig

    def __init__(self, config: PromptDatasetConfig | None = None):
        """Load the rows and the reward function (both cached per process)."""
        super().__init__(config)
        cfg = self.config
        self.records: list[PromptRecord] = load_prompts(cfg.files, cfg.prompt_key, cfg.ground_truth_key)
        self.reward_fn = load_reward_fn(cfg.reward_fn_path, cfg.reward_fn_name)
        self.record: PromptRecord | None = None
        self.steps: list[str] = []
        self.done, self.success, self.last_score = False, False, 0.0

    def reset(self, seed: int | None = None, **kwargs: Any) -> str:
        """Serve the row at dataset position ``seed``."""
        cfg = self.config
        self.record = self.records[row_for_position(seed or 0, len(self.records), cfg.shuffle, cfg.shuffle_seed)]
        self.steps, self.done, self.success, self.last_score = [], False, False, 0.0
        return self.render()

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        """A reasoning step (reward 0) or the final answer (scored); empty text is invalid."""
        valid = isinstance(action, str) and 0 < len(action.strip()) <= MAX_ANSWER_CHARS
        if not valid or self.done or self.record is None:
            return self.render(), 0.0, self.done, make_info(self.success, False, False, **self._question())
        final, answer = self._final_answer(action)
        if not final:
            self.steps.append(action.strip())
            return self.render(), 0.0, False, make_info(False, True, True, final_answer=0.0, **self._question())
        rec = self.record
        self.last_score = score(self.reward_fn, rec.data_source, answer, rec.ground_truth, rec.extra_info)
        self.done, self.success = True, self.last_score > 0
        info = make_info(self.success, True, True, final_answer=1.0, score=self.last_score, **self._question())
        return self.render(), self.last_score, True, info

    def _question(self) -> dict:
        """Which row this episode serves, for trajectory reward computers (``reward_computation``).

        ``question_id``: the row's ``extra_info.id`` (else its ``index``, else its file position);
        ``ground_truth``: the row's ground truth as stored (text, or e.g. ``{"tests": [...]}`` for code).
        """
        rec = self.record
        if rec is None:
            return {}
        qid = rec.extra_info.get("id", rec.extra_info.get("index", rec.where))
        return {"question_id": str(qid), "ground_truth": rec.ground_truth}

    def _final_answer(self, action: str) -> tuple[bool, str]:
        """(is final, the text to score)."""
        cfg = self.config
        if cfg.max_turns == 1:
            return True, action.strip()
        idx = action.lower().rfind(cfg.final_marker.lower())
        if idx >= 0:
            return True, action[idx + len(cfg.final_marker):].strip()
        return len(self.steps) + 1 >= cfg.max_turns, action.strip()

    def render(self) -> str:
        """The question, and the reasoning steps so far (question environment)."""
        if self.record is None:
            return ""
        text = self.record.prompt_text()
        if self.steps:
            text += "\n" + "\n".join(f"Step {i}: {s}" for i, s in enumerate(self.steps, start=1))
        return text

    def action_description(self) -> str:
        """What an answer looks like."""
        if self.config.max_turns == 1:
            return "the final answer only, e.g. 42"
        return (f"one reasoning step, or '{self.config.final_marker} <answer>' to answer "
                f"(at most {self.config.max_turns} turns)")

    def expert_action(self) -> str:
        """The ground truth as a final answer (an oracle for tests)."""
        if self.record is None or self.record.ground_truth is None:
            raise NotImplementedError("this row has no ground truth")
        truth = str(self.record.ground_truth)
        return truth if self.config.max_turns == 1 else f"{self.config.final_marker} {truth}"
