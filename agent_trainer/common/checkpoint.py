"""Full checkpoints: layout, atomic saves, resume discovery, RNG state, pruning.

Layout under ``trainer.default_local_dir`` (verl's names)::

    latest_checkpointed_iteration.txt      the step of the newest complete checkpoint (written last)
    global_step_N/
        actor/        config.json, tokenizer; model.safetensors with trainer.save_hf_model -> an HF folder
            shards/   each rank's shards of weights and optimizer state + index.json
                      (agent_trainer/workers/sharded_checkpoint.py)
            optim/    lr_scheduler.json
            rng/      rank_<r>.json (python, numpy, torch RNG of each rank)
        critic/       the same for the value model (AutoModelForTokenClassification)
        trainer_state.json   global step, KL controller, env seed counters, driver RNG
        config.yaml          the resolved config of the run that saved it (``agent_trainer.eval --checkpoint``'s)
        eval/                what ``python -m agent_trainer.eval --checkpoint`` wrote about it

A save writes into ``.tmp_global_step_N`` and renames it when every part is
on disk; only then is ``latest_checkpointed_iteration.txt`` replaced (also by
rename). A process killed mid-save leaves the previous checkpoint, and the
pointer to it, untouched; the partial folder is removed at the next start.

Everything is safetensors or JSON/YAML: nothing read back from a run
directory is unpickled. This module is light (no Ray, no FSDP): the driver
and the workers both use it.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from agent_trainer.config.splits import Split

logger = logging.getLogger(__name__)

LATEST_FILE = "latest_checkpointed_iteration.txt"
STEP_PREFIX = "global_step_"
TMP_PREFIX = ".tmp_" + STEP_PREFIX
STATE_FILE = "trainer_state.json"
RESUME_MODES = ("auto", "disable", "resume_path")
RUN_FILES = ("metrics.jsonl", "tensorboard", LATEST_FILE)
"""What a run writes into its folder besides the checkpoints (archived on a fresh start)."""


# --------------------------------------------------------------------------- state records


@dataclass
class TrainerState:
    """What the driver needs to continue exactly where a checkpoint was taken."""

    global_step: int
    """The last finished training step."""
    env_resets: dict[Split, int] = field(default_factory=dict)
    """Resets done per split (train, val): the env seed counters (``es_manager.group_seeds``); JSON holds the
    split's text, read back as a :class:`~agent_trainer.config.splits.Split`."""
    kl_coef: float | None = None
    """The KL-in-reward controller's current coefficient (None without KL-in-reward)."""
    rng: dict[str, Any] = field(default_factory=dict)
    """The driver's python / numpy / torch RNG states (:func:`rng_state`)."""
    parts: list[str] = field(default_factory=list)
    """Sub-folders this checkpoint holds (``actor``, ``critic``)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The saved step's metrics (re-logged on resume when the run died between saving and logging)."""
    saved_at: float = 0.0
    """Unix time of the save."""

    def __post_init__(self):
        self.env_resets = {Split(split): int(n) for split, n in self.env_resets.items()}

    def save(self, folder: Path) -> None:
        write_json(folder / STATE_FILE, asdict(self))

    @classmethod
    def load(cls, folder: Path) -> TrainerState:
        return cls(**read_json(folder / STATE_FILE))


# --------------------------------------------------------------------------- files


def write_json(path: Path, obj: Any) -> None:
    """Write JSON through a temporary file and a rename (never a half-written file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(obj))


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


def read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files of a Hugging Face folder."""
    from safetensors.torch import load_file

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(str(file)))
    return weights


# --------------------------------------------------------------------------- RNG


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch in this process."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """This process's python, numpy and torch RNG states as JSON-able values."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state().tolist(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


# --------------------------------------------------------------------------- optimizer state


def flatten_optimizer_state(osd: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Split a (full, name-keyed) optimizer state dict into safetensors tensors and JSON metadata.

    ``state[param][key]`` tensors become ``"state/<key>/<param>"``; numbers stay in the
    JSON next to ``param_groups``.
    """
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for param, entries in osd["state"].items():
        for key, value in entries.items():
            if torch.is_tensor(value):
                tensors[f"state/{key}/{param}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(param), {})[key] = value
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in osd["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def unflatten_optimizer_state(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    """Inverse of :func:`flatten_optimizer_state`."""
    state: dict[str, dict[str, Any]] = {p: dict(v) for p, v in meta["scalars"].items()}
    for name, value in tensors.items():
        _, key, param = name.split("/", 2)
        state.setdefault(param, {})[key] = value
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


# --------------------------------------------------------------------------- discovery and saves


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / f"{STEP_PREFIX}{step}"


def is_complete(folder: Path) -> bool:
    """A renamed (not temporary) checkpoint folder whose state file, written last, is there."""
    folder = Path(folder)
    return folder.name.startswith(STEP_PREFIX) and (folder / STATE_FILE).is_file()


def check_parts(folder: Path, parts: list[str]) -> None:
    """Raise ValueError when the checkpoint lacks a model part this run needs (e.g. no critic/)."""
    missing = [p for p in parts if not (Path(folder) / p / "config.json").is_file()]
    if missing:
        raise ValueError(f"checkpoint {folder} has no {missing} state (saved by a run without it, or pruned by "
                         "trainer.max_*_ckpt_to_keep), but this run needs it; resume from another checkpoint "
                         "(trainer.resume_mode=resume_path trainer.resume_from_path=...) or start over with "
                         "trainer.resume_mode=disable")


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every ``global_step_N`` folder, oldest first."""
    found = []
    for child in Path(run_dir).glob(f"{STEP_PREFIX}*"):
        m = re.fullmatch(rf"{STEP_PREFIX}(\d+)", child.name)
        if m and child.is_dir():
            found.append((int(m.group(1)), child))
    return sorted(found)


def find_latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint: the one ``latest_checkpointed_iteration.txt`` names, else by scan."""
    run_dir = Path(run_dir)
    pointer = run_dir / LATEST_FILE
    if pointer.is_file():
        text = pointer.read_text().strip()
        if text.isdigit() and is_complete(step_dir(run_dir, int(text))):
            return step_dir(run_dir, int(text))
        logger.warning("%s names %r, which is not a complete checkpoint; scanning %s", pointer, text, run_dir)
    complete = [folder for _, folder in list_checkpoints(run_dir) if is_complete(folder)]
    return complete[-1] if complete else None


def begin_save(run_dir: Path, step: int) -> Path:
    """A fresh temporary folder for step ``step``'s checkpoint."""
    tmp = Path(run_dir) / f"{TMP_PREFIX}{step}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit_save(run_dir: Path, tmp: Path, step: int) -> Path:
    """Rename the finished temporary folder into place, then point ``latest`` at it."""
    final = step_dir(run_dir, step)
    if final.exists():  # an older run's checkpoint of this step (after resuming from an earlier one)
        archived = archive(Path(run_dir), [final.name], reason=f"superseded by a new {final.name}")
        logger.warning("moved the existing %s to %s", final, archived)
    os.replace(tmp, final)
    write_text_atomic(Path(run_dir) / LATEST_FILE, str(step))
    return final


def save_step(run_dir: Path, step: int, write: Callable[[Path], None], state: Callable[[], TrainerState]) -> Path:
    """Step ``step``'s checkpoint, atomically; returns ``global_step_<step>``. ``write(tmp)`` fills a fresh
    temporary folder (the workers' parts, the tokenizer, the config), ``state()``'s record is written beside them
    last, then the folder is renamed into place and ``latest`` pointed at it. The RL trainer and SFT save
    through here."""
    tmp = begin_save(run_dir, step)
    write(tmp)
    state().save(tmp)
    return commit_save(run_dir, tmp, step)


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` through a temporary file in the same folder and a rename."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def prune(run_dir: Path, part: str, keep: int | None) -> list[Path]:
    """Delete ``part`` (actor or critic) of all but the newest ``keep`` checkpoints.

    A checkpoint left without any model part is removed whole. Returns the deleted paths.
    """
    if keep is None:
        return []
    holding = [folder for _, folder in list_checkpoints(run_dir) if (folder / part).is_dir()]
    deleted = []
    for folder in holding[: max(0, len(holding) - keep)]:
        shutil.rmtree(folder / part)
        deleted.append(folder / part)
        if not any((folder / p).is_dir() for p in ("actor", "critic")):
            shutil.rmtree(folder)
    return deleted


def archive(run_dir: Path, names: list[str], reason: str) -> Path | None:
    """Move ``names`` (files or folders of the run directory) into ``archive/<time>/``; nothing is deleted."""
    present = [n for n in names if (Path(run_dir) / n).exists()]
    if not present:
        return None
    dest = Path(run_dir) / "archive" / time.strftime("%Y%m%d-%H%M%S")
    while dest.exists():
        dest = dest.with_name(dest.name + "_")
    dest.mkdir(parents=True)
    for name in present:
        os.replace(Path(run_dir) / name, dest / name)
    (dest / "REASON.txt").write_text(reason + "\n")
    return dest


def prepare_run_dir(run_dir: Path, resume_mode: str, resume_from_path: str | None, parts: list[str]) -> Path | None:
    """Decide where the run starts, before any worker does; return the checkpoint to resume from.

    Removes partial saves of a killed run. ``auto``: the latest complete checkpoint, or a
    fresh start; ``resume_path``: ``resume_from_path`` (must be complete); ``disable``: a
    fresh start. A fresh start moves an earlier run's metrics, event files and
    checkpoints into ``archive/`` so steps are never logged twice and nothing saved is
    overwritten. Raises ValueError naming the key when the resume target is unusable.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for partial in run_dir.glob(f"{TMP_PREFIX}*"):
        logger.warning("removing %s: a save that did not finish (the run was killed while saving)", partial)
        shutil.rmtree(partial)
    if resume_mode == "resume_path":
        path = Path(resume_from_path or "")
        if not resume_from_path or not is_complete(path):
            raise ValueError(f"trainer.resume_from_path = {resume_from_path!r} is not a complete checkpoint "
                             f"(a {STEP_PREFIX}N folder holding {STATE_FILE}); point it at one, or use "
                             "trainer.resume_mode=auto")
        check_parts(path, parts)
        return path
    if resume_mode == "auto":
        latest = find_latest(run_dir)
        if latest is not None:
            check_parts(latest, parts)
            return latest
    old = [name for name in RUN_FILES if (run_dir / name).exists()] + [f.name for _, f in list_checkpoints(run_dir)]
    if old:
        dest = archive(run_dir, old, reason=f"a new run started here with trainer.resume_mode={resume_mode}")
        logger.warning("an earlier run's files in %s were moved to %s (resume_mode=%s starts from model_path)",
                       run_dir, dest, resume_mode)
    return None


def truncate_metrics(jsonl: Path, last_step: int) -> int:
    """Drop the lines of steps after ``last_step`` (logged by a run killed before its next save).

    Returns the number of lines dropped.
    """
    if not jsonl.exists():
        return 0
    lines = jsonl.read_text().splitlines()
    keep = [line for line in lines if line.strip() and json.loads(line).get("step", 0) <= last_step]
    if len(keep) != len(lines):
        write_text_atomic(jsonl, "".join(line + "\n" for line in keep))
    return len(lines) - len(keep)
