"""Hydra entry point: ``python -m agent_trainer.main --config-name frozenlake key=value ...``.

The config is merged onto the typed schema and validated before Ray starts: a
mistake exits non-zero with one line on stderr naming the key, the value and the fix
(:func:`main`). ``ray.init()`` starts a local cluster, or joins ``RAY_ADDRESS`` when
it is set (``ray job submit`` sets it).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Sequence

import hydra
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from agent_trainer import cli_args, core_algos, watchdog
from agent_trainer.training import memory_plan
from agent_trainer.observe import run_logs
from agent_trainer.checks.distill import check_teacher_vocabulary
from agent_trainer.checks.load import load_config
from agent_trainer.checks.preflight import preflight_envs
from agent_trainer.checks.rl import check_lora_targets
from agent_trainer.checks.services import check_services
from agent_trainer.config import AgentTrainerConfig, config_schema
from agent_trainer.config import compat
from agent_trainer.config import errors as config_errors
from agent_trainer.config.splits import CONFIG_SPLITS
from agent_trainer.episode.prompt_data import check_datasets, dataset_env_tags
from envs import load_env_tags
from envs.registry import tags_folder

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parents[1] / "config"

# base.yaml lists this schema first in its defaults, so every typed key can be overridden
# without "+" and hydra rejects unknown keys and wrong types while composing. "+key=value"
# still adds a key the schema lacks; load_config refuses it (agent_trainer/config/errors.py).
ConfigStore.instance().store(name="agent_trainer_schema", node=AgentTrainerConfig)

CONFIG_ERRORS = (ValueError, HydraException, OmegaConfBaseException)
"""What a config mistake raises before Ray starts: hydra's composition, OmegaConf's typing, the checks."""
LOCAL_PATH_PREFIXES = ("/", "./", "../", "~", "models/")
"""A model path starting like this is a local folder, never a hub id."""


def check_inputs(cfg: AgentTrainerConfig, env_tags: dict) -> None:
    """Checks that need the file system, the model's config.json or the env tags, still before Ray starts."""
    for split in CONFIG_SPLITS:
        for tag in getattr(cfg.es_manager, split).env_configs.tags:
            if tag not in env_tags:
                raise ValueError(f"es_manager.{split}.env_configs.tags names {tag!r}, which is not a tag in "
                                 f"{cfg.envs_file}; known tags: {sorted(env_tags)}")
    resume = cfg.trainer.resume_from_path
    if resume is not None and not Path(resume).is_dir():
        raise ValueError(f"trainer.resume_from_path = {resume!r} is not a folder; point it at a checkpoint "
                         "folder (<run dir>/global_step_N)")
    model = resolve_model("actor_rollout_ref.model.path", cfg.actor_rollout_ref.model.path)
    check_lora_targets(cfg, model)
    if core_algos.critic_enabled(cfg) and cfg.critic.model.path != cfg.actor_rollout_ref.model.path:
        resolve_model("critic.model.path", cfg.critic.model.path)
    if cfg.reward_model.enable:
        rm_labels = resolve_model("reward_model.model.path", cfg.reward_model.model.path).num_labels
        if rm_labels != 1:
            raise ValueError(f"reward_model.model.path = {cfg.reward_model.model.path!r} has num_labels = {rm_labels}; "
                             "a reward model gives one score per text (AutoModelForSequenceClassification with "
                             "num_labels=1), e.g. models/tiny-qwen2-rm")
    if cfg.algorithm.distill.enable:
        teacher = resolve_model("algorithm.distill.teacher_path", cfg.algorithm.distill.teacher_path)
        check_teacher_vocabulary(cfg, model, teacher)
    text_config = model.get_text_config() if hasattr(model, "get_text_config") else model
    max_positions = getattr(text_config, "max_position_embeddings", None)
    max_model_len = cfg.actor_rollout_ref.rollout.max_model_len
    if isinstance(max_positions, int) and max_model_len > max_positions:
        raise ValueError(f"actor_rollout_ref.rollout.max_model_len = {max_model_len} is more than the model's "
                         f"max_position_embeddings = {max_positions} ({cfg.actor_rollout_ref.model.path}); set "
                         f"actor_rollout_ref.rollout.max_model_len={max_positions} or less")


def resolve_model(key: str, path: str):
    """The model's ``PretrainedConfig``, loaded in the driver: a local folder, or a hub id (hub or cache)."""
    if not path.strip():
        raise ValueError(f"{key} = {path!r} is empty; set model_path to a Hugging Face folder or hub id (org/name)")
    if not Path(path).expanduser().exists():
        if "/" not in path:
            raise ValueError(f"{key} = {path!r} is not a local folder, and a name without 'org/' is not a Hugging "
                             "Face hub id; give the folder's path (e.g. models/tiny-qwen2) or org/name")
        if path.startswith(LOCAL_PATH_PREFIXES) or path.count("/") > 1:
            raise ValueError(f"{key} = {path!r} does not exist; build the tiny model with `make model` "
                             "(python -m launch.build_tiny_model --out models/tiny-qwen2) or set model_path "
                             "to a Hugging Face folder or hub id (org/name)")
    folder = Path(path).expanduser()
    if _adapter_only(folder):
        raise ValueError(f"{key} = {path!r} is a LoRA adapter folder (adapter_config.json, no model weights): set "
                         "model_path to the base model it was trained on and actor_rollout_ref.model.lora_adapter_path "
                         "to this folder, with its lora_rank / lora_alpha / target_modules (docs/lora.md)")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except Exception as err:  # noqa: BLE001 - any failure (missing, offline, malformed) is a config error
        reason = " ".join(f"{type(err).__name__}: {err}".split())[:300]
        raise ValueError(f"{key} = {path!r} cannot be loaded as a Hugging Face model ({reason}); set model_path "
                         "to a folder with a config.json or a reachable (or cached) hub id") from None


def _adapter_only(folder: Path) -> bool:
    """``folder`` holds a peft adapter and no model weights (a LoRA SFT's ``final/``, a LoRA checkpoint's actor)."""
    if not (folder / "adapter_config.json").is_file():
        return False
    return not any(f.name != "adapter_model.safetensors" for f in folder.glob("*.safetensors*"))


def load_envs_file(path: str) -> dict:
    """The env tags of ``envs_file``; a missing or malformed file is a config error naming the key."""
    import yaml

    if not Path(path).is_file():
        raise ValueError(f"envs_file = {path!r} is not a file; point it at a YAML of env tags (like "
                         "config/envs.yaml) or leave it empty for config/envs.yaml")
    try:
        return load_env_tags(path)
    except (ValueError, OSError, ImportError, yaml.YAMLError) as err:
        raise ValueError(f"envs_file = {path!r}: {' '.join(str(err).split())}") from None


WORKERS_AT_NORMAL_PRIORITY = {"worker_niceness": 0}
"""Ray starts its workers at niceness 15 to keep its own control plane responsive; in a training run the workers
are the job, and at 15 any unrelated process at normal priority starves them (beside a 2-process busy loop on
2 cores a vLLM engine call went from seconds to past its 600 s timeout). A local cluster runs them at 0;
``RAY_worker_niceness`` in the environment wins. A cluster from ``ray start`` keeps its own setting."""

LOCAL_CLUSTER_SYSTEM_CONFIG = {"enable_worker_prestart": False, "prestart_worker_first_driver": False,
                               **WORKERS_AT_NORMAL_PRIORITY}
"""Ray's system config for a local cluster: workers at normal priority (above), and no idle workers started ahead
(one per CPU by default). Every worker of a run is an actor that needs a process of its own (its own environment
variables, or the job's), so the idle ones were never used: on 2 cores they cost 2 processes and about 1.5 s of
the cluster's start."""


def local_cluster_system_config(base: dict) -> dict:
    """``base`` plus Ray system settings the environment does not set itself (``RAY_<name>`` wins)."""
    return {key: value for key, value in base.items() if f"RAY_{key}" not in os.environ}


def init_ray(cfg: AgentTrainerConfig) -> None:
    """Start a local Ray cluster on loopback, or join the one in ``RAY_ADDRESS``; log the dashboard URL.

    The run gets its own namespace, ``agent_trainer.<experiment_name>.<time>-<random>``, in which every
    worker is a named actor (``actor_rank0``, ``rollout_0``, ``env_train_3``, ...; docs/cluster.md).
    A local cluster is one node whose address is 127.0.0.1: GCS, raylet, workers, the dashboard (on
    ``trainer.dashboard_host``) and the torch rendezvous listen on loopback only.
    """
    import time
    import uuid

    import ray

    if ray.is_initialized():
        return
    run_logs.quiet_driver_loggers()  # Ray's token line at ray.init: into workers.log, not the console
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    namespace = f"agent_trainer.{cfg.trainer.experiment_name}.{stamp}"
    # Ray's own INFO lines (its dashboard line among them) stay quiet; the run logs one line below.
    if os.environ.get("RAY_ADDRESS"):
        # joins the cluster in RAY_ADDRESS (set for drivers started by `ray job submit`)
        ctx = ray.init(namespace=namespace, logging_level=logging.WARNING, log_to_driver=False)
    else:
        _single_node_on_loopback()
        ctx = ray.init(address="local", num_cpus=cfg.trainer.ray_num_cpus, include_dashboard=True,
                       dashboard_host=cfg.trainer.dashboard_host, dashboard_port=cfg.trainer.dashboard_port,
                       namespace=namespace, log_to_driver=False, logging_level=logging.WARNING,
                       runtime_env={"env_vars": {"PYTHONPATH": worker_pythonpath(cfg.envs_file)}},
                       _system_config=local_cluster_system_config(LOCAL_CLUSTER_SYSTEM_CONFIG))
        watchdog.start()  # a hard kill of this driver takes the whole local cluster with it
    url = f"http://{ctx.dashboard_url}" if ctx.dashboard_url else "not running on this cluster"
    token_auth = os.environ.get("RAY_AUTH_MODE") == "token"  # Ray's default for a new local cluster
    sign_in = " (sign in with the token `ray get-auth-token` prints)" if token_auth else ""
    logger.info("Ray dashboard: %s%s; workers are named actors in namespace %s", url, sign_in, namespace)
    # worker output (vLLM's INFO lines among it) goes to <run dir>/logs/workers.log; warnings once on the console
    run_logs.route_worker_logs(cfg.trainer.default_local_dir)


def worker_pythonpath(envs_file: str = "") -> str:
    """The PYTHONPATH of every worker of a local run: the run's directory, the folder of a user's ``envs_file``
    (``envs.registry.import_beside``), then the user's PYTHONPATH.

    Absolute paths, so a user module named by import path (an env's ``module:Class``) imports in
    every worker exactly as in the driver, whatever directory Ray starts a worker in. (``ray job
    submit`` ships the job's ``working_dir`` to the workers itself.)
    """
    beside = [str(tags_folder(envs_file))] if envs_file and tags_folder(envs_file) else []
    entries = [os.getcwd(), *beside] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys(str(Path(p).resolve()) for p in entries))


def _single_node_on_loopback() -> None:
    """Make the next local ``ray.init`` use 127.0.0.1 as the node address, so Ray listens on loopback only.

    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is Ray's switch for a single-node, loopback cluster (its
    default on macOS and Windows). Ray reads it when ``ray`` is imported, so the constant is set too;
    the environment variable reaches the processes Ray starts.
    """
    from ray._private import ray_constants

    if not hasattr(ray_constants, "ENABLE_RAY_CLUSTER"):
        raise RuntimeError("this Ray version has no ray_constants.ENABLE_RAY_CLUSTER; "
                           "agent_trainer cannot keep a local cluster on 127.0.0.1 (see init_ray)")
    os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def prepare(raw_cfg: DictConfig | dict, overrides: Sequence[str] = ()) -> tuple[AgentTrainerConfig, dict]:
    """Validate the config, the env tags and the model, and preflight the splits' environments (raises ValueError
    naming the key or the tag and the fix; ``agent_trainer.checks.preflight``).

    ``overrides``: the command line's, which win over a config file's align-anything sections (compat.py).
    """
    cfg = load_config(raw_cfg, overrides)
    if not cfg.envs_file:
        cfg.envs_file = str(CONFIG_DIR / "envs.yaml")
    env_tags = load_envs_file(cfg.envs_file)
    env_tags.update(dataset_env_tags(cfg))  # data.train_files / val_files as prompt_dataset tags
    check_inputs(cfg, env_tags)
    check_services(cfg, env_tags)  # an env tag's server (env_type openenv) answers with its key
    memory_plan.check_config(cfg)  # trainer.gpu_memory_gib: the per-GPU memory plan (docs/cluster.md)
    if cfg.data.train_files:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.actor_rollout_ref.model.path)
        check_datasets(cfg, env_tags, lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"]))
    seconds = preflight_envs(cfg, env_tags)  # each split's tag built, reset and stepped (es_manager.preflight)
    if seconds:
        logger.debug("env preflight: %s", ", ".join(f"{tag} {s:.3f} s" for tag, s in seconds.items()))
    return cfg, env_tags


def compose_and_prepare(overrides: Sequence[str] = (), config_name: str = "frozenlake",
                        ) -> tuple[AgentTrainerConfig, dict]:
    """What :func:`main` does before ``ray.init``, for a config name and overrides (tests, notebooks).

    A mistake raises SystemExit with the same one line the command line prints.
    """
    try:
        overrides, notices = compat.rewrite_overrides(overrides)  # align-anything / RAGEN keys (docs/compatibility.md)
        for notice in notices:
            logger.warning(notice)
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            raw = compose(config_name, overrides=list(overrides))
        return prepare(raw, overrides)
    except CONFIG_ERRORS as err:
        raise SystemExit(refusal(err, overrides)) from None


def refusal(err: BaseException, overrides: Sequence[str] = ()) -> str:
    """The one line a config mistake exits with."""
    return f"agent-trainer: {config_errors.one_line(err, config_schema(), overrides)}"


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
            ray.shutdown()


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
