"""Hydra entry point: ``python -m agent_trainer.main --config-name frozenlake key=value ...``.

hydra composes the config; every start-up check runs before Ray starts
(``agent_trainer.checks.prepare``, shared with ``sft``, ``eval`` and ``plan``): a mistake exits non-zero with
one line on stderr naming the key, the value and the fix (:func:`main`). ``ray.init()`` starts a local cluster,
or joins ``RAY_ADDRESS`` when it is set (``agent_trainer.ray_cluster``; ``ray job submit`` sets it).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from agent_trainer import cli_args
from agent_trainer.checks.prepare import CONFIG_DIR, CONFIG_ERRORS, prepare, refusal
from agent_trainer.config import AgentTrainerConfig, compat
from agent_trainer.ray_cluster import init_ray, shutdown_ray
logger = logging.getLogger(__name__)


def check_local_placement(cfg: AgentTrainerConfig) -> None:
    """A local run whose workers need more CPUs than the cluster it would start is refused before Ray starts.

    The cluster's CPUs are known in advance: ``trainer.ray_num_cpus``, else what Ray detects (the machine's, or
    its cgroup's quota). A cluster in ``RAY_ADDRESS`` is checked once joined (``agent_trainer.workers.build``), GPUs
    too.
    """
    if os.environ.get("RAY_ADDRESS"):
        return
    cpus = cfg.trainer.ray_num_cpus
    if cpus is None:
        try:
            from ray._private.utils import get_num_cpus  # what ray.init(num_cpus=None) uses
        except ImportError:  # another Ray version: the check after ray.init still runs
            return
        cpus = get_num_cpus()
    from agent_trainer.workers.build import check_placement, resource_demands  # the worker classes: torch, ray

    check_placement(resource_demands(cfg, "cpu"), {"CPU": float(cpus)})  # CPU demands do not depend on the device


def train(cfg: AgentTrainerConfig, env_tags: dict) -> list[dict[str, float]]:
    """Start Ray and the workers, train; return every step's metrics."""
    from transformers import AutoTokenizer

    from agent_trainer.training import lifecycle
    from agent_trainer.rollout.results import EnvFailure
    from agent_trainer.training.trainer import AgentTrainer
    from agent_trainer.trajectory_rewards.judge import JudgeFailure
    from agent_trainer.workers.build import build_workers
    from agent_trainer.workers.worker_group import PlacementError

    tokenizer = AutoTokenizer.from_pretrained(cfg.actor_rollout_ref.model.path)
    try:  # where the run starts (trainer.resume_mode) is decided, or refused, before Ray starts
        check_local_placement(cfg)
        trainer = AgentTrainer(cfg, tokenizer, env_tags, build_workers=build_workers)
    except (ValueError, PlacementError) as err:
        forget_hydra_record()
        raise SystemExit(refusal(err)) from None
    OmegaConf.save(OmegaConf.structured(cfg), Path(cfg.trainer.default_local_dir) / "config.yaml")
    with lifecycle.StopSignal() as stop:
        try:
            init_ray(cfg)
            trainer.init_workers(build_workers(cfg))  # the workers are built here and handed to the trainer
            if stop.signum is not None:  # a signal during start-up: nothing trained, nothing to save
                raise lifecycle.Interrupted(stop.signum)
            return trainer.fit(stop)
        except lifecycle.Interrupted as err:
            logger.warning("%s: shutting every worker down; exit code %d", err, err.exit_code)
            exit_with: int | str = err.exit_code
        except (PlacementError, lifecycle.WorkerLost, EnvFailure, JudgeFailure) as err:  # one line: what stopped it
            exit_with = f"agent-trainer: {' '.join(str(err).split())}"
        finally:
            try:
                shutdown(trainer)
            except lifecycle.Interrupted as err:  # another signal while shutting down: stop now (the watchdog
                raise SystemExit(err.exit_code) from None  # of a local run kills what is left)
    raise SystemExit(exit_with)


def shutdown(trainer) -> None:
    """Kill every worker of the run, then end Ray (a local cluster's processes exit with it)."""
    import ray

    if ray.is_initialized():
        try:
            trainer.shutdown()
        finally:
            shutdown_ray()


_RAISE_COMPOSE_ERRORS = "HYDRA_FULL_ERROR"
_raise_set_by_main = False
_compat_notices: list[str] = []
"""The notices of main's rewrite of align-anything / RAGEN keys, logged once the run's logging is set up."""


# An absolute path: "../config" would name the package "config" when main is imported rather than run as a script.
@hydra.main(version_base=None, config_path=str(CONFIG_DIR), config_name="frozenlake")
def _run(cfg: DictConfig) -> None:
    """The run, once hydra composed the config."""
    global _raise_set_by_main
    if _raise_set_by_main:  # errors of the run itself get hydra's usual report again
        os.environ.pop(_RAISE_COMPOSE_ERRORS, None)
        _raise_set_by_main = False
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for notice in _compat_notices:
        logger.warning(notice)
    try:
        typed, env_tags = prepare(cfg, _cli_overrides())
    except CONFIG_ERRORS as err:
        forget_hydra_record()
        raise SystemExit(refusal(err, _cli_overrides())) from None
    train(typed, env_tags)


def forget_hydra_record() -> None:
    """A run refused before it starts leaves no folder: hydra wrote its record of the run (``.hydra/`` and its log
    file, in ``<trainer.default_local_dir>/hydra/<date>_<time>/``, config/base.yaml) before the config was checked,
    so those are removed, then each folder above them that this leaves empty: the record's, ``hydra/``, the run
    folder, and the folders inside the working directory that led to it. Nothing else is removed (a folder that
    holds anything else stays, as does any folder of a ``hydra.run.dir`` set elsewhere but the record's own)."""
    import shutil

    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():  # compose_and_prepare, tests: no hydra run, no record
        return
    hydra_cfg = HydraConfig.get()
    record = Path(hydra_cfg.runtime.output_dir).resolve()
    if hydra_cfg.output_subdir:
        shutil.rmtree(record / hydra_cfg.output_subdir, ignore_errors=True)
    (record / f"{hydra_cfg.job.name}.log").unlink(missing_ok=True)
    cwd = Path.cwd().resolve()
    folders = [record]
    if record.parent.name == "hydra":  # config/base.yaml's layout: then hydra/, the run folder, the ones to it
        folders += [record.parent, record.parent.parent]
        folders += [f for f in record.parent.parent.parents if cwd in f.parents]
    for folder in folders:
        if folder == cwd:
            break
        try:
            folder.rmdir()  # only an empty one
        except OSError:
            break


def main() -> None:
    """Console entry point (hydra parses ``--config-name`` and ``key=value`` overrides).

    Every config mistake exits non-zero with one line on stderr, before Ray starts. hydra prints
    its composition errors (a key that does not exist, a value of the wrong type) as a multi-line
    report and exits, unless ``HYDRA_FULL_ERROR=1``, in which case it raises them: main sets it
    while hydra composes (``_run`` takes it back) and turns those errors into the one line. A
    user who sets HYDRA_FULL_ERROR=1 gets hydra's full traceback, as hydra documents.
    """
    global _raise_set_by_main
    try:
        _rewrite_compat_argv()
    except ValueError as err:
        raise SystemExit(refusal(err)) from None
    _raise_set_by_main = _RAISE_COMPOSE_ERRORS not in os.environ
    if _raise_set_by_main:
        os.environ[_RAISE_COMPOSE_ERRORS] = "1"
    user_wants_traceback = not _raise_set_by_main
    if any(arg in cli_args.HELP_FLAGS for arg in sys.argv[1:]):  # the config names first, then hydra's help
        print(cli_args.config_choices_text(CONFIG_DIR), flush=True)
    try:
        _run()
    except (HydraException, OmegaConfBaseException) as err:
        if user_wants_traceback:
            raise
        raise SystemExit(refusal(err, _cli_overrides())) from None
    finally:
        if _raise_set_by_main:
            os.environ.pop(_RAISE_COMPOSE_ERRORS, None)
            _raise_set_by_main = False


def _rewrite_compat_argv() -> None:
    """Rewrite align-anything / RAGEN keys among the overrides in ``sys.argv`` before hydra composes.

    hydra refuses a key the schema lacks while composing, so ``train_cfgs.gamma=0.9`` becomes
    ``algorithm.gamma=0.9`` here (compat.py); a refused key raises ValueError with one line.
    """
    overrides = _cli_overrides()
    rewritten, _compat_notices[:] = compat.rewrite_overrides(overrides)
    others = [arg for arg in sys.argv[1:] if arg not in overrides]
    sys.argv[1:] = others + rewritten


def _cli_overrides() -> list[str]:
    return [arg for arg in sys.argv[1:] if "=" in arg and not arg.startswith("-")]


if __name__ == "__main__":
    main()
