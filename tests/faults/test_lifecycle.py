"""Fast checks of the pieces behind tests/faults/test_process_faults.py: no Ray cluster, a few seconds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from agent_trainer.training import lifecycle
from agent_trainer import watchdog
from agent_trainer.checks.prepare import compose_and_prepare
from agent_trainer.ray_cluster import worker_pythonpath
from agent_trainer.workers.build import Demand, check_placement, resource_demands
from agent_trainer.workers.worker_group import PlacementError, death_cause

pytestmark = pytest.mark.faults


def test_the_reported_deadlock_is_refused_listing_every_demand(tiny_model_path):
    cfg, _ = compose_and_prepare([f"model_path={tiny_model_path}", "critic.colocate=false", "critic.fsdp.world_size=2",
                                  "actor_rollout_ref.rollout.num_workers=2"])
    demands = resource_demands(cfg, "cpu")
    assert [(d.what, d.count, d.cpus) for d in demands] == [
        ("actor", 2, 0.25), ("critic", 2, 0.25), ("rollout", 2, 0.5), ("env_train", 2, 0.1), ("env_val", 2, 0.1)]
    with pytest.raises(PlacementError, match=r"need 2.4 CPU but the Ray cluster has 2 \(actor 2 x 0.25, critic 2 x "
                                             r"0.25, rollout 2 x 0.5, env_train 2 x 0.1, env_val 2 x 0.1\)"):
        check_placement(demands, {"CPU": 2.0})
    check_placement(demands, {"CPU": 2.4})  # exactly enough is enough


def test_engine_threads_follow_the_model_size_unless_set(tiny_model_path, monkeypatch):
    """rollout.num_threads 0 (auto): 1 thread for the tiny model, 2 from AUTO_ENGINE_THREADS_MIN_PARAMETERS on, 1 again
    when the engine shares the cores with training (overlap) or with a second engine; a set value wins."""
    import agent_trainer.workers.build as build
    from agent_trainer.workers.rollout import checkpoint_parameters

    def threads(*overrides: str) -> int:
        return build.engine_threads(compose_and_prepare([f"model_path={tiny_model_path}", *overrides])[0])

    built = json.loads((Path(tiny_model_path) / "build_info.json").read_text())["n_params"]  # ~0.6M, with the vocab
    assert checkpoint_parameters(tiny_model_path) == built and checkpoint_parameters("Qwen/Qwen2.5-0.5B") is None
    assert threads() == 1
    monkeypatch.setattr(build, "AUTO_ENGINE_THREADS_MIN_PARAMETERS", 600_000)
    assert threads() == 2
    assert threads("trainer.max_off_policy_steps=1", "algorithm.rollout_correction.rollout_is=token") == 1
    assert threads("actor_rollout_ref.rollout.num_workers=2") == 1
    assert threads("actor_rollout_ref.rollout.num_threads=3") == 3


@pytest.mark.parametrize("colocate", [True, False])
def test_a_colocated_reference_or_critic_asks_for_nothing_of_its_own(tiny_model_path, colocate):
    flag = str(colocate).lower()
    cfg, _ = compose_and_prepare([f"model_path={tiny_model_path}", "actor_rollout_ref.actor.use_kl_loss=true",
                                  f"actor_rollout_ref.ref.colocate={flag}", f"critic.colocate={flag}"])
    demands = [d.what for d in resource_demands(cfg, "cuda")]
    assert demands == ["actor"] + ([] if colocate else ["critic", "ref"]) + ["rollout", "env_train", "env_val"]


def test_the_distillation_teacher_asks_for_its_own_ranks_unless_colocated(tiny_model_path):
    cfg, _ = compose_and_prepare([f"model_path={tiny_model_path}", "algorithm.adv_estimator=grpo",
                                  "algorithm.distill.enable=true", f"algorithm.distill.teacher_path={tiny_model_path}",
                                  "algorithm.distill.fsdp.world_size=2", "algorithm.distill.fsdp.num_cpus_per_rank=0.5"])
    demands = [(d.what, d.count, d.cpus, d.gpus) for d in resource_demands(cfg, "cuda")]
    assert ("teacher", 2, 0.5, 1.0) in demands
    cfg, _ = compose_and_prepare([f"model_path={tiny_model_path}", "algorithm.adv_estimator=grpo",
                                  "algorithm.distill.enable=true", f"algorithm.distill.teacher_path={tiny_model_path}",
                                  "algorithm.distill.colocate=true"])
    assert "teacher" not in [d.what for d in resource_demands(cfg, "cuda")]  # hosted by the actor's ranks


@pytest.mark.parametrize("overrides, env_splits", [
    ([], ["env_train", "env_val"]),
    (["trainer.test_freq=0"], ["env_train"]),  # never validates: no val env actors are started or asked for
    (["trainer.test_freq=0", "algorithm.adv_estimator=remax"], ["env_train", "env_remax_baseline"]),
])
def test_env_actors_are_asked_for_each_split_the_run_plays(tiny_model_path, overrides, env_splits):
    cfg, _ = compose_and_prepare([f"model_path={tiny_model_path}", *overrides])
    assert [d.what for d in resource_demands(cfg, "cpu") if d.what.startswith("env_")] == env_splits


def test_each_rollout_in_flight_asks_for_env_actors_of_its_own(tiny_model_path):
    """trainer.rollouts_in_flight (default k with async_mode=continuous): one set of train env actors per rollout."""
    cfg, _ = compose_and_prepare([f"model_path={tiny_model_path}", "algorithm.adv_estimator=grpo",
                                  "trainer.max_off_policy_steps=2", "trainer.async_mode=continuous"])
    assert [(d.what, d.count) for d in resource_demands(cfg, "cpu") if d.what.startswith("env_")] == [
        ("env_train", 4), ("env_val", 2)]


def test_gpus_are_counted_too():
    with pytest.raises(PlacementError, match="need 3 GPU but the Ray cluster has 2"):
        check_placement([Demand("actor", 2, 0.25, 1.0), Demand("rollout", 1, 0.5, 1.0)], {"CPU": 8.0, "GPU": 2.0})


def test_a_first_signal_asks_to_stop_and_a_second_interrupts():
    # the handler before (Python's default_int_handler; SIG_IGN when the run was started in the background)
    before = signal.getsignal(signal.SIGINT)
    with lifecycle.StopSignal() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert stop.signum == signal.SIGTERM
        with pytest.raises(lifecycle.Interrupted) as info:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    assert info.value.exit_code == 130
    assert signal.getsignal(signal.SIGINT) is before  # the old handler is back


def test_workers_get_the_run_directory_and_the_users_pythonpath_as_absolute_paths(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["mods", str(tmp_path), "", "mods"]))
    assert worker_pythonpath().split(os.pathsep) == [str(tmp_path.resolve()), str((tmp_path / "mods").resolve())]
    tags = tmp_path / "elsewhere" / "my_envs.yaml"  # a user's envs_file: its folder too, after the run's directory
    assert worker_pythonpath(str(tags)).split(os.pathsep) == [str(tmp_path.resolve()), str(tags.parent.resolve()),
                                                              str((tmp_path / "mods").resolve())]
    shipped = Path(__file__).resolve().parents[2] / "config" / "envs.yaml"  # the shipped file adds nothing
    assert worker_pythonpath(str(shipped)) == worker_pythonpath()


def test_death_cause_is_one_line_cut_at_a_sentence():
    err = RuntimeError("The actor died.\n  " + "Because of a long reason. " * 40)
    text = death_cause(err)
    assert "\n" not in text and len(text) <= 600 and text.endswith(".")


def test_the_watchdog_kills_the_ray_processes_of_a_driver_killed_with_sigkill(tmp_path):
    """A stand-in driver starts a Ray-like process (a script under ``ray/``, with a child) and an unrelated
    one, then is SIGKILLed: the watchdog kills the first two and leaves the third alone."""
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "raylet.py").write_text(
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        "time.sleep(120)\n")
    code = ("import subprocess, sys, time\n"
            f"ray = subprocess.Popen([sys.executable, {str(tmp_path / 'ray' / 'raylet.py')!r}])\n"
            "other = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)', 'trainer.ray_num_cpus=2'])\n"
            "print(ray.pid, other.pid, flush=True)\n"
            "time.sleep(120)\n")
    driver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    ray_pid, other_pid = (int(p) for p in driver.stdout.readline().split())
    while not psutil.Process(ray_pid).children():  # however slowly a loaded machine starts it
        time.sleep(0.1)
    ray_child = psutil.Process(ray_pid).children()[0]
    seen = tmp_path / "seen"
    guard = watchdog.start(driver.pid, str(seen))
    # the watchdog has noted both (it notes a process's descendants in the same pass), whatever the load
    while not (seen.is_file() and str(ray_child.pid) in seen.read_text().split()):
        assert guard.poll() is None, "the watchdog exited before it saw the Ray processes"
        time.sleep(0.1)
    driver.kill()
    driver.wait()
    guard.wait(timeout=300)  # a hang guard, not a speed bound
    gone = [not psutil.pid_exists(ray_pid) or psutil.Process(ray_pid).status() == psutil.STATUS_ZOMBIE,
            not ray_child.is_running() or ray_child.status() == psutil.STATUS_ZOMBIE]
    other_alive = psutil.Process(other_pid).is_running()
    for proc in [psutil.Process(pid) for pid in (ray_pid, other_pid) if psutil.pid_exists(pid)] + [ray_child]:
        if proc.is_running():
            proc.kill()
    assert gone == [True, True] and other_alive  # not below a Ray process: left alone


def test_no_watchdog_module_state_leaks_into_agent_trainer_imports():
    out = subprocess.run([sys.executable, "-c", "import sys, agent_trainer.training.lifecycle, agent_trainer.watchdog; "
                          "print('torch' in sys.modules)"], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "False"
