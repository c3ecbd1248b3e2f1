"""The Ray cluster of a run: a local one on loopback, or the one in ``RAY_ADDRESS``; shared by every entry point.

``python -m agent_trainer.main``, ``sft`` and ``eval`` start Ray here (:func:`init_ray`) once their config passed
every start-up check (``agent_trainer.checks.prepare``). A local cluster runs its workers at normal priority, with
the run's directory and the user's ``envs_file`` folder on their PYTHONPATH, and a watchdog that takes the cluster
down with a hard-killed driver (``agent_trainer.watchdog``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from agent_trainer.observe import run_logs
from agent_trainer import watchdog
from agent_trainer.config import AgentTrainerConfig
from envs.registry import tags_folder

logger = logging.getLogger(__name__)


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


def shutdown_ray() -> None:
    """``ray.shutdown()``, with no object of Ray's freed on another thread while the core worker goes away.

    ``ray.shutdown`` destroys the process's core worker a moment before it drops Python's handle on it. A thread
    that reaches the core worker in that moment makes Ray end the whole process at once, with exit code 1 and no
    trace. The usual way there: an ``ObjectRef`` or actor handle left in a reference cycle (a caught Ray error's
    traceback holds the refs of the call that failed) is freed by the cyclic garbage collector, which runs on
    whichever thread happens to allocate (tqdm's monitor, Ray's own listener, a library's worker thread). So the
    garbage is collected here, on this thread, while the core worker still lives, and the automatic collector
    stays off until the shutdown returns. Every entry point and test ends Ray through this function; in a process
    that never imported Ray it does nothing (a refused config ends without importing it).
    """
    import gc
    import sys

    ray = sys.modules.get("ray")
    if ray is None:  # Ray never imported here: nothing to end
        return
    gc.collect()
    automatic = gc.isenabled()
    gc.disable()
    try:
        ray.shutdown()
    finally:
        if automatic:
            gc.enable()


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
