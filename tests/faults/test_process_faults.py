"""Process faults through the real command line: dead FSDP ranks, signals, placement, user env modules.

Every case starts ``python -m agent_trainer.main`` in a subprocess (its own session) on the tiny
model, watches every process the run starts (the driver's descendants: gcs, raylet, Ray workers)
and asserts the documented outcome (docs/reliability.md) and that none of them is left afterwards.
A rank is killed with SIGKILL inside its ``update_actor``: the run's first rank to make the N-th call is held
there (``tests/pausing.py``), its process title Ray's ``ray::ActorWorker.update_actor``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Callable

import psutil
import pytest
from pausing import held_pid, pause_env

pytestmark = [pytest.mark.e2e, pytest.mark.faults]
REPO = Path(__file__).resolve().parents[2]
LEFT_BEHIND_WAIT_S = 10
UPDATE = "agent_trainer.workers.actor:ActorWorker.update_actor"

USER_ENV = '''
"""A user environment outside the repository, named by import path (docs/writing_an_environment.md)."""
from dataclasses import dataclass

from envs import BaseEnv, make_info


@dataclass
class SayConfig:
    word: str = "yes"


class SayEnv(BaseEnv):
    config_cls = SayConfig

    def reset(self, seed=None, **kwargs):
        return self.render()

    def step(self, action):
        ok = isinstance(action, str) and action.strip().lower() == self.config.word
        return self.render(), float(ok), True, make_info(ok, True, True)

    def render(self):
        return f"Say {self.config.word}."
{action_description}
'''
ACTION_DESCRIPTION = '''
    def action_description(self):
        return f"the word {self.config.word}"
'''


def _user_env(tmp_path: Path, complete: bool = True) -> tuple[Path, Path]:
    """A module dir (for PYTHONPATH) and an envs file naming ``say_env_fault:SayEnv`` by import path."""
    mods = tmp_path / "user_code"
    mods.mkdir(exist_ok=True)
    code = USER_ENV.replace("{action_description}", ACTION_DESCRIPTION if complete else "")
    (mods / "say_env_fault.py").write_text(textwrap.dedent(code))
    envs_file = tmp_path / "user_envs.yaml"
    envs_file.write_text("Say:\n  env_type: say_env_fault:SayEnv\n  max_actions_per_traj: 1\n  max_tokens: 16\n"
                         "  env_config: {word: 'yes'}\n")
    return mods, envs_file


def _args(model: str, run_dir: Path, steps: int, envs_file: Path | None = None, extra: tuple = ()) -> list[str]:
    tags = ["envs_file=" + str(envs_file), "es_manager.train.env_configs.tags=[Say]",
            "es_manager.val.env_configs.tags=[Say]"] if envs_file else \
        ["es_manager.train.env_configs.tags=[FrozenLake3x3]", "es_manager.val.env_configs.tags=[FrozenLake3x3]"]
    return [f"model_path={model}", f"trainer.default_local_dir={run_dir}", f"hydra.run.dir={run_dir}/hydra",
            f"trainer.total_training_steps={steps}", "trainer.test_freq=0", "trainer.progress_bar=false",
            "algorithm.adv_estimator=grpo", "agent_proxy.max_turn=1", "agent_proxy.num_env_actors=1",
            "es_manager.train.env_groups=1", "es_manager.train.group_size=4", "es_manager.train.env_configs.n_groups=[1]",
            "es_manager.val.env_groups=1", "es_manager.val.env_configs.n_groups=[1]",
            "ppo_mini_batch_size=4", "micro_batch_size_per_gpu=2", "actor_rollout_ref.rollout.response_length=8",
            *tags, *extra]


def _alive(p: psutil.Process) -> bool:
    """``p`` runs and is not a zombie; False when it ends while being looked at (psutil's NoSuchProcess)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class Run:
    """One CLI run in its own session; remembers every process it started."""

    def __init__(self, args: list[str], log: Path, pythonpath: Path | None = None, pause: str | None = None):
        """``pause``: ``module:qualname@N``, the run's first process to make that N-th call is held in it
        (:meth:`held`)."""
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "HYDRA_FULL_ERROR")}
        self.marker = log.with_suffix(".held")
        if pause is not None:
            env = pause_env(pause, self.marker, (pythonpath,) if pythonpath else (), base=env)
        elif pythonpath is not None:
            env["PYTHONPATH"] = str(pythonpath)
        self.log = log
        with log.open("w") as sink:
            self.proc = subprocess.Popen([sys.executable, "-m", "agent_trainer.main", "--config-name", "frozenlake",
                                          *args], cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.seen: dict[int, psutil.Process] = {}
        self.titles: list[str] = []
        """The command line of every process of the run when first seen."""

    def watch(self) -> list[psutil.Process]:
        """The run's live descendants (also remembered for :meth:`left_behind`)."""
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return []
        for child in children:
            if child.pid not in self.seen:
                self.seen[child.pid] = child
                try:
                    self.titles.append(" ".join(child.cmdline()))
                except psutil.Error:
                    pass
        return children

    def held(self, title: str) -> psutil.Process:
        """The process held at the run's pause point once one is; it must be titled ``title`` (Ray's
        ``ray::Class.method`` while a call runs). Every process of the run so far is remembered."""
        process = psutil.Process(held_pid(self.marker, self.proc, lambda: self.output()[-3000:]))
        self.watch()
        assert title in " ".join(process.cmdline()), process.cmdline()
        return process

    def wait_until(self, done: Callable[[], bool], deadline: float) -> None:
        """Watch the run until ``done()``; it must stay alive and finish before ``deadline`` (``time.monotonic()``)."""
        while not done():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.output()[-3000:]
            self.watch()
            time.sleep(0.05)

    def wait(self, timeout: float = 600) -> int:
        """Wait for the driver, watching its processes meanwhile; returns its exit code."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            assert time.monotonic() < deadline, f"still running after {timeout} s:\n{self.output()[-3000:]}"
            self.watch()
            time.sleep(0.1)
        return self.proc.returncode

    def left_behind(self, within: float = LEFT_BEHIND_WAIT_S) -> list[str]:
        """Processes of the run still alive ``within`` seconds from now (killed afterwards, so none leaks)."""
        deadline = time.monotonic() + within
        alive = [p for p in self.seen.values() if _alive(p)]
        while alive and time.monotonic() < deadline:
            time.sleep(0.5)
            alive = [p for p in alive if _alive(p)]
        names = []
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):  # it may end between the check and here
                names.append(f"{p.pid} {' '.join(p.cmdline())[:80]}")
                p.kill()
        return names

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def _last_line(run: Run) -> str:
    return [line for line in run.output().splitlines() if line.strip()][-1]


# -- dead FSDP rank -----------------------------------------------------------------------------------------


def test_a_killed_actor_rank_restarts_from_its_checkpoint_then_sigint_saves_and_exits_130(tiny_model_path, tmp_path):
    """max_restarts=1, a checkpoint every 2 steps: rank 1 dies in step 3's update; the run restarts from
    global_step_2 and trains step 3 again, during which SIGINT ends it at the step boundary with a checkpoint
    of step 3 (not a regular save) and exit code 130, leaving no process behind.

    The env is a user module outside the repository, named by import path and found via PYTHONPATH
    in every Ray worker.
    """
    mods, envs_file = _user_env(tmp_path)
    run_dir = tmp_path / "run"
    run = Run(_args(tiny_model_path, run_dir, 4, envs_file, ("trainer.save_freq=2", "trainer.max_restarts=1")),
              tmp_path / "restart.log", pythonpath=mods, pause=f"{UPDATE}@3")  # step 3's update
    deadline = time.monotonic() + 600
    victim = run.held("ActorWorker.update_actor")
    assert (run_dir / "global_step_2").is_dir()
    victim.kill()
    # "resumed from" is logged once the restarted workers hold global_step_2, before step 3 is trained again:
    # a SIGINT now lands in the repeated step 3 even when the machine is busy (a whole step to arrive in)
    run.wait_until(lambda: "resumed from" in run.output(), deadline)
    run.proc.send_signal(signal.SIGINT)
    assert run.wait(timeout=180) == 130, run.output()[-4000:]
    out = run.output()
    assert "actor rank" in out and "restart 1 of trainer.max_restarts = 1" in out, out[-3000:]
    assert "resumed from" in out and "global_step_2" in out, out[-3000:]
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text() == "3"  # saved at the step boundary
    assert (run_dir / "global_step_3" / "trainer_state.json").is_file()
    assert not (run_dir / "global_step_4").exists()
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert steps == [1, 2, 3], steps
    assert run.left_behind() == []


def test_a_killed_rank_without_restarts_exits_naming_it_and_a_sigkilled_driver_leaves_nothing(tiny_model_path,
                                                                                               tmp_path):
    """Two runs started side by side (their start-ups share the cores), each with more steps than it lives:

    - max_restarts 0 (the default): a rank killed in an update ends the run within 60 s, exit code non-zero,
      its last line naming the rank and ``trainer.max_restarts``;
    - SIGKILL of the driver (nothing in it runs again) mid-update: the watchdog takes the local cluster down.

    Neither leaves a process behind."""
    norestart = Run(_args(tiny_model_path, tmp_path / "norestart", 50), tmp_path / "norestart.log",
                    pause=f"{UPDATE}@1")
    sigkill = Run(_args(tiny_model_path, tmp_path / "sigkill", 50), tmp_path / "sigkill.log", pause=f"{UPDATE}@1")
    try:
        sigkill.held("ActorWorker.update_actor")
        assert len(sigkill.seen) >= 5  # gcs, raylet, actor ranks, engine, env actors
        sigkill.proc.kill()
        sigkill.proc.wait(timeout=10)

        victim = norestart.held("ActorWorker.update_actor")
        killed_at = time.monotonic()
        victim.kill()
        code = norestart.wait(timeout=120)
        assert code != 0 and time.monotonic() - killed_at < 60, norestart.output()[-3000:]
        line = _last_line(norestart)
        assert line.startswith("agent-trainer: actor rank ") and "trainer.max_restarts" in line, line
    finally:
        for run in (sigkill, norestart):  # a failed assertion above leaves a driver running: its watchdog ends
            if run.proc.poll() is None:  # its cluster
                run.proc.kill()
        left = {"sigkill": sigkill.left_behind(), "norestart": norestart.left_behind()}
    assert left == {"sigkill": [], "norestart": []}


# -- refused before anything trains -----------------------------------------------------------------------


def test_an_unsatisfiable_placement_is_refused_in_one_line(tiny_model_path, tmp_path):
    """The reported deadlock: the placement groups take both CPUs and the env actors are never placed. A local
    cluster's CPUs are known before it starts (trainer.ray_num_cpus), so the run is refused before Ray starts."""
    args = [f"model_path={tiny_model_path}", f"trainer.default_local_dir={tmp_path}/run",
            f"hydra.run.dir={tmp_path}/hydra", "critic.colocate=false", "critic.fsdp.world_size=2",
            "actor_rollout_ref.rollout.num_workers=2",
            "trainer.ray_num_cpus=2", "trainer.total_training_steps=1"]
    run = Run(args, tmp_path / "placement.log")
    assert run.wait(timeout=180) == 1, run.output()[-3000:]
    line = _last_line(run)
    assert line.startswith("agent-trainer: the workers need 2.4 CPU but the Ray cluster has 2 ("), line
    for demand in ("actor 2 x 0.25", "critic 2 x 0.25", "rollout 2 x 0.5", "env_train 2 x 0.1", "env_val 2 x 0.1"):
        assert demand in line, line
    assert not any("raylet" in title for title in run.titles), run.titles  # a local cluster's CPUs are known: refused
    assert run.left_behind() == []  # before Ray started


def test_an_env_class_with_abstract_methods_is_refused_before_ray_starts(tiny_model_path, tmp_path):
    mods, envs_file = _user_env(tmp_path, complete=False)
    run = Run(_args(tiny_model_path, tmp_path / "run", 1, envs_file), tmp_path / "abstract.log", pythonpath=mods)
    assert run.wait(timeout=180) == 1, run.output()[-3000:]
    line = _last_line(run)
    assert line.startswith("agent-trainer: ") and "class SayEnv does not implement action_description" in line, line
    assert not any("raylet" in title for title in run.titles), run.titles  # refused before Ray started
