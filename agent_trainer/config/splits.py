"""The split a rollout plays, as a typed value (:class:`Split`).

A :class:`~enum.StrEnum`: a member is its text ("train", "val", "remax_baseline"), so metric names, file names,
Ray actor names, JSON (trajectory records, ``trainer_state.json``'s ``env_resets``) keep the text they always had,
a member compares equal to that text, and ``Split("val")`` reads it back (checkpoints written before load as they
are). Defined in the config layer because ``es_manager.train`` / ``es_manager.val`` (:data:`CONFIG_SPLITS`) name
their split.
"""

from __future__ import annotations

from enum import StrEnum


class Split(StrEnum):
    """Which episodes a rollout plays: the training groups, the validation groups, or one greedy episode per
    training group replaying the training step's group seeds (ReMax's baseline)."""

    TRAIN = "train"
    VAL = "val"
    REMAX_BASELINE = "remax_baseline"

    @property
    def metric_prefix(self) -> str:
        """The prefix of the split's rollout metrics: ``rollout`` for train, else the split's text (the trainer
        reports the ReMax baseline as ``rollout/remax_baseline_*``)."""
        return "rollout" if self is Split.TRAIN else self.value


CONFIG_SPLITS: tuple[Split, ...] = (Split.TRAIN, Split.VAL)
"""The splits with a config section of their own (``es_manager.train``, ``es_manager.val``)."""
