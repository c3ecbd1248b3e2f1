"""The batch contract, checked by the framework on every batch an agent builds (not trusted to the agent).

Token-in/token-out (docs/architecture.md): ``response_mask`` is 1 exactly on the tokens the rollout
engine generated for the episode, in the order it generated them, and ``input_ids`` holds those
very ids there (a reply decoded and re-tokenized may give other ids, and the policy would then be
trained on tokens it never sampled). The rollout keeps the engine's raw ids per episode and turn
(``SyncMultiTurnRollout.last_generations``); :func:`check_batch_contract` compares, per episode
(``traj_uid``), the ids under the mask of its rows, in row order, with those ids concatenated.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from agent_trainer.common.batch import TensorBatch

REQUIRED_KEYS = ("input_ids", "attention_mask", "position_ids", "response_mask", "token_level_rewards",
                 "rollout_log_probs", "uid", "traj_uid")
"""Keys every training batch has (``ctx_manager.collate_rows`` makes them, and the estimators' extras)."""
PER_TOKEN_KEYS = ("attention_mask", "position_ids", "response_mask", "token_level_rewards", "rollout_log_probs")


class BatchContractError(RuntimeError):
    """An agent's batch breaks the contract: names the agent class, the episode and the position."""


def check_batch_contract(batch: TensorBatch, generations: Mapping[int, list[list[int]]], agent: str,
                         describe: Callable[[int], str] = str) -> None:
    """Raise :class:`BatchContractError` unless every row's masked ids are the engine's ids for its episode.

    ``generations[traj_uid]`` is the list of the episode's generated id lists, one per turn;
    ``agent`` names the agent class and ``describe(traj_uid)`` the episode in the message.
    """
    _check_keys(batch, agent)
    ids, mask = batch["input_ids"], batch["response_mask"]
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise BatchContractError(f"agent {agent}: response_mask holds values other than 0 and 1")
    if bool(((mask == 1) & (batch["attention_mask"] == 0)).any()):
        row, col = (int(v) for v in ((mask == 1) & (batch["attention_mask"] == 0)).nonzero()[0])
        raise BatchContractError(f"agent {agent}: row {row} position {col} has response_mask 1 but attention_mask 0")
    rows_of: dict[int, list[int]] = {}
    for row, uid in enumerate(batch["traj_uid"].tolist()):
        rows_of.setdefault(int(uid), []).append(row)
    for uid, rows in rows_of.items():
        if uid not in generations:
            raise BatchContractError(f"agent {agent}: row {rows[0]} has traj_uid {uid}, which is no episode of this "
                                     f"rollout (known: {sorted(generations)[:10]}...); traj_uid is the episode's env_id")
        _check_episode(ids, mask, rows, generations[uid], f"agent {agent} broke the batch contract in {describe(uid)}")


def _check_keys(batch: TensorBatch, agent: str) -> None:
    missing = [k for k in REQUIRED_KEYS if k not in batch]
    if missing:
        raise BatchContractError(f"agent {agent} built a batch without {missing}; build it with "
                                 "agent_trainer.agents.ctx_manager.collate_rows (docs/agents.md)")
    shape = tuple(batch["input_ids"].shape)
    wrong = [k for k in PER_TOKEN_KEYS if tuple(batch[k].shape) != shape]
    if wrong:
        raise BatchContractError(f"agent {agent}: {wrong} must have the shape of input_ids {list(shape)}, got "
                                 f"{[list(batch[k].shape) for k in wrong]}")


def _check_episode(ids: torch.Tensor, mask: torch.Tensor, rows: list[int], turns: list[list[int]],
                   where: str) -> None:
    """The episode's masked ids (its rows in order) must equal its generated ids (its turns in order)."""
    columns = [mask[row].nonzero().flatten() for row in rows]
    positions = [(row, col) for row, cols in zip(rows, columns) for col in cols.tolist()]
    got = [token for row, cols in zip(rows, columns) for token in ids[row, cols].tolist()]
    expected = [(t, k, token) for t, turn in enumerate(turns, start=1) for k, token in enumerate(turn)]
    if got == [token for _, _, token in expected]:
        return
    i = next((i for i, (g, e) in enumerate(zip(got, expected)) if g != e[2]), min(len(got), len(expected)))
    rule = ("response_mask must be 1 exactly on the ids the engine generated, in order and unchanged "
            "(token-in/token-out; docs/agents.md)")
    if i < len(got) and i < len(expected):
        (row, col), (turn, k, token) = positions[i], expected[i]
        raise BatchContractError(f"{where}: row {row} position {col} has response_mask 1 on token id {got[i]}, but "
                                 f"the engine generated id {token} there (turn {turn}, token {k}); {rule}")
    if i < len(got):
        row, col = positions[i]
        raise BatchContractError(f"{where}: row {row} position {col} has response_mask 1 on token id {got[i]}, which "
                                 f"the engine did not generate (it generated {len(expected)} tokens); {rule}")
    turn, k, token = expected[i]
    raise BatchContractError(f"{where}: response_mask covers {len(got)} of the {len(expected)} generated tokens; "
                             f"the first left out is turn {turn}, token {k} (id {token}); {rule}")
