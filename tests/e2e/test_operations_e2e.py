"""What a person running ``make train`` sees: the console, the Ray dashboard, live metrics, trajectories, curves;
then ``python -m agent_trainer.eval`` on the run's checkpoint.

One real CLI run (local Ray, FSDP2 actor and critic, vLLM engine, env actors on the tiny model).
While it trains, the test reads the node's Prometheus endpoint (Ray's metrics export) and the
dashboard's actor list, as a user's Prometheus or browser would; afterwards it checks the
console output, the run directory, and the viewer in headless Chromium.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.agent_trainer.test_viewer import CHROMIUM_NAMES, chromium, headless

pytestmark = pytest.mark.e2e
STEPS = 3
NAMED = ("actor_rank0", "actor_rank1", "rollout_0", "env_train_0", "env_val_0")
"""Workers a person finds by name on the dashboard's Actors page (the critic lives in the actor ranks)."""


def _get(url: str, token: str | None = None, timeout: float = 5.0) -> bytes:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as resp:
        return resp.read()


def _find(data, key: str):
    """Every value of ``key`` anywhere in a JSON document."""
    if isinstance(data, dict):
        for k, v in data.items():
            yield from ([v] if k == key else []) + list(_find(v, key))
    elif isinstance(data, list):
        for item in data:
            yield from _find(item, key)


class DevToolsPage:
    """A headless Chromium page driven over the DevTools protocol (to send the dashboard's token cookie)."""

    def __init__(self, profile: Path):
        from websockets.sync.client import connect

        self.proc = subprocess.Popen([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                                      "--remote-debugging-port=0", f"--user-data-dir={profile}", "--window-size=1400,900",
                                      "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text().strip():
            if time.monotonic() > deadline:
                raise TimeoutError("chromium wrote no DevToolsActivePort")
            time.sleep(0.2)
        port = port_file.read_text().split()[0]
        pages = json.loads(_get(f"http://127.0.0.1:{port}/json/list"))
        self.ws = connect(next(p for p in pages if p["type"] == "page")["webSocketDebuggerUrl"], max_size=2**26)
        self.next_id = 0

    def call(self, method: str, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self.ws.recv(timeout=60))
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def text(self) -> str:
        return self.call("Runtime.evaluate", expression="document.body ? document.body.innerText : ''",
                         returnByValue=True)["result"].get("value", "")

    def close(self) -> None:
        self.ws.close()
        self.proc.terminate()
        self.proc.wait(timeout=30)


def look_at_dashboard(url: str, token: str | None, names: tuple[str, ...], shot: Path, profile: Path) -> str:
    """Open the dashboard's Actors page as a signed-in person; wait until ``names`` show; screenshot it."""
    page = DevToolsPage(profile)
    try:
        if token:
            page.call("Network.enable")
            page.call("Network.setCookie", name="ray-authentication-token", value=token, url=url)
        page.call("Page.navigate", url=f"{url}/#/actors")
        deadline, text = time.monotonic() + 90, ""
        while time.monotonic() < deadline and not all(n in text for n in names):
            time.sleep(1.0)
            text = page.text()
        shot.write_bytes(base64.b64decode(page.call("Page.captureScreenshot", format="png")["data"]))
        return text
    finally:
        page.close()


class Watcher:
    """Reads the run's console as it comes; polls its dashboard and Prometheus endpoint while it trains."""

    def __init__(self, proc: subprocess.Popen, token: str | None, artifacts: Path):
        self.proc, self.token, self.artifacts = proc, token, artifacts
        self.dashboard_text: str | None = None
        """What the dashboard's Actors page showed in Chromium (None: not looked at)."""
        self.lines: list[str] = []
        self.dashboard: str | None = None
        self.actor_names: set[str] = set()
        self.samples: dict[str, float] = {}
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            for line in raw.replace("\r", "\n").splitlines():
                self.lines.append(line)
                if match := re.search(r"Ray dashboard: (http://[\d.]+:\d+)", line):
                    self.dashboard = match.group(1)

    def poll(self) -> None:
        """Collect named actors and the project's metrics until the run ends."""
        metrics_url = None
        while self.proc.poll() is None:
            time.sleep(1.0)
            if self.dashboard is None:
                continue
            try:
                actors = json.loads(_get(f"{self.dashboard}/api/v0/actors?limit=1000&detail=false", self.token))
                self.actor_names |= {n for n in _find(actors, "name") if n}
                if self.dashboard_text is None and set(NAMED) <= self.actor_names and any(
                        shutil.which(n) for n in CHROMIUM_NAMES):
                    self.dashboard_text = look_at_dashboard(self.dashboard, self.token, NAMED,
                                                            self.artifacts / "dashboard_actors.png",
                                                            self.artifacts / "chromium-profile")
                if metrics_url is None:
                    nodes = json.loads(_get(f"{self.dashboard}/nodes?view=summary", self.token))
                    port = next((p for p in _find(nodes, "metricsExportPort") if p), None)
                    metrics_url = f"http://127.0.0.1:{port}/metrics" if port else None
                if metrics_url:
                    self._scrape(metrics_url)
            except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
                continue

    def _scrape(self, url: str) -> None:
        for line in _get(url).decode().splitlines():
            if line.startswith("ray_agent_trainer_"):
                name_labels, value = line.rsplit(" ", 1)
                name = name_labels.split("{")[0]
                labels = dict(re.findall(r'(\w+)="([^"]*)"', name_labels))
                key = name + "".join(f"[{labels[k]}]" for k in ("split", "env_tag", "phase") if k in labels)
                self.samples[key] = float(value)


@pytest.fixture(scope="module")
def run(tiny_model_path, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ops") / "run"
    cmd = [sys.executable, "-m", "agent_trainer.main", "--config-name", "frozenlake", f"model_path={tiny_model_path}",
           f"trainer.default_local_dir={run_dir}", f"trainer.total_training_steps={STEPS}",
           f"trainer.test_freq={STEPS}", "trainer.log_trajectories_freq=2", "trainer.log_trajectories_per_tag=2",
           f"trainer.save_freq={STEPS}",
           "trainer.logger=[console,jsonl]", "trainer.experiment_name=ops_e2e",
           "es_manager.train.env_groups=2", "es_manager.train.group_size=4",
           "es_manager.train.env_configs.tags=[FrozenLake3x3,Bandit]", "es_manager.train.env_configs.n_groups=[1,1]",
           "es_manager.val.env_groups=2", "es_manager.val.env_configs.n_groups=[2]", "ppo_mini_batch_size=4",
           "micro_batch_size_per_gpu=2", "agent_proxy.max_turn=2", "actor_rollout_ref.rollout.response_length=24"]
    # Ray exports metrics every 10 s by default; a short interval lets the test see them mid-run
    env = {**os.environ, "RAY_metrics_report_interval_ms": "500", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=Path(__file__).resolve().parents[2])
    token_file = Path.home() / ".ray" / "auth_token"
    watcher = Watcher(proc, token_file.read_text().strip() if token_file.exists() else None, run_dir.parent)
    try:
        watcher.poll()
        proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, "\n".join(watcher.lines[-60:])
    return watcher, run_dir


def test_console_is_one_line_per_step_and_no_vllm_info(run):
    watcher, _ = run
    text = "\n".join(watcher.lines)
    assert not [line for line in watcher.lines if "training:" in line]  # no progress bar when not on a terminal
    started = next(i for i, line in enumerate(watcher.lines) if re.match(r"step +\d+/\d+ ", line))
    after = watcher.lines[started:]
    assert not [line for line in after if re.search(r"\bINFO \d\d-\d\d \d\d:", line)], text[-4000:]
    assert sum("RotaryEmbedding: Failed to load weights" in line for line in watcher.lines) <= 1, text[-4000:]
    step_lines = [line for line in after if re.match(r"step +\d+/\d+  succ", line)]
    assert len(step_lines) == STEPS and all(len(line) <= 160 for line in step_lines), step_lines
    assert len({line.index("  rew ") for line in step_lines}) == 1  # aligned
    assert all(re.search(r"  valid [01]\.\d\d  .*  ppo_kl ", line) for line in step_lines), step_lines
    other = [line for line in after if line.strip() and not line.startswith(("training:", "step "))]
    assert len(other) <= 5, other  # a warning shown once, Ray's shutdown lines; not a block per step


def test_worker_logs_are_in_the_run_directory(run):
    _, run_dir = run
    logs = (run_dir / "logs" / "workers.log").read_text()
    assert logs.count("Successfully reset prefix cache") >= STEPS  # vLLM's per-step INFO line lives here
    assert "Starting to load model" in logs  # the engine worker's start-up INFO line


def test_third_party_start_up_warnings_stay_in_the_log_and_off_the_console(run):
    watcher, run_dir = run
    from agent_trainer.observe.run_logs import QUIET

    logs = (run_dir / "logs" / "workers.log").read_text().splitlines()
    in_log = {q.text for q in QUIET for line in logs if q.matches(line)}
    assert "RotaryEmbedding: Failed to load weights" in in_log and len(in_log) >= 3, in_log  # vLLM printed them
    on_console = [line for line in watcher.lines for q in QUIET if q.matches(line)]
    assert not on_console, on_console


def test_live_metrics_reach_the_prometheus_endpoint(run):
    watcher, _ = run
    s = watcher.samples
    assert s.get("ray_agent_trainer_step", 0) >= 1, s
    for tag in ("FrozenLake3x3", "Bandit"):
        assert 0.0 <= s[f"ray_agent_trainer_success_rate[train][{tag}]"] <= 1.0
        assert -10.0 < s[f"ray_agent_trainer_episode_reward_mean[train][{tag}]"] < 10.0
    assert 0 < s["ray_agent_trainer_phase_seconds[rollout]"] < 300
    assert 0 < s["ray_agent_trainer_weight_sync_seconds"] < 60
    assert s["ray_agent_trainer_generated_tokens_per_s"] > 0 and s["ray_agent_trainer_env_steps_per_s"] > 0


def test_dashboard_lists_the_named_workers(run):
    watcher, _ = run
    assert watcher.dashboard and watcher.dashboard.startswith("http://127.0.0.1:")
    for name in NAMED:
        assert name in watcher.actor_names, sorted(watcher.actor_names)


def test_a_person_sees_the_named_workers_on_the_dashboard_in_chromium(run):
    watcher, run_dir = run
    chromium()  # skips, naming the package, where Chromium is missing
    assert watcher.dashboard_text is not None, "the run ended before every named worker was listed"
    for name in NAMED:
        assert name in watcher.dashboard_text, watcher.dashboard_text[:3000]
    assert (run_dir.parent / "dashboard_actors.png").stat().st_size > 10_000


def test_trajectories_viewer_and_curves_are_written(run, tmp_path):
    _, run_dir = run
    folder = run_dir / "trajectories"
    assert sorted(p.name for p in folder.glob("*.jsonl")) == ["step_2.jsonl", f"step_{STEPS}.jsonl"]
    records = [json.loads(line) for line in (folder / "step_2.jsonl").read_text().splitlines()]
    assert {r["tag"] for r in records} == {"FrozenLake3x3", "Bandit"} and len(records) == 4
    turn = records[0]["turns"][0]
    assert sum(turn["mask"]) > 0 and len(turn["advantage"]) == len(turn["mask"]) == len(turn["tokens"])
    dom = headless("--dump-dom", (folder / "viewer.html").as_uri())
    assert len(re.findall(r"<button[^>]*>", dom)) >= 8 + 2 and 'class="tok gen"' in dom and "Turn 1" in dom
    shot = tmp_path / "viewer.png"
    headless("--window-size=1200,900", f"--screenshot={shot}", (folder / "viewer.html").as_uri())
    assert shot.stat().st_size > 10_000
    pngs = {p.name for p in (run_dir / "plots").glob("*.png")}
    assert {"success.png", "reward.png", "losses.png", "timing.png"} <= pngs


def test_evaluating_the_checkpoint_starts_no_trainer_worker(run, tiny_model_path, tmp_path):
    """``--checkpoint``: the run's own config (its val seeds, turns, reply length are not repeated), the outputs
    beside the checkpoint, an override on top."""
    from agent_trainer.observe.run_logs import QUIET

    _, run_dir = run
    out = run_dir / f"global_step_{STEPS}" / "eval"
    cmd = [sys.executable, "-m", "agent_trainer.eval", "--checkpoint", str(run_dir), "eval.k=2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "eval_report.json").read_text())
    assert report["model_path"] == str(run_dir / f"global_step_{STEPS}" / "actor") and report["seeds"] == 2
    assert report["greedy"]["episodes"] == 2 and report["sampled"]["episodes"] == 4 and report["sampled"]["k"] == 2
    tag = report["sampled"]["per_tag"]["FrozenLakeDescribed"]  # config/frozenlake.yaml's val tag
    assert 0 <= tag["success_rate"] <= tag["pass@2"] <= 1 and -5 < tag["episode_reward_mean"] < 5
    assert sorted(p.name for p in (out / "trajectories").glob("*.jsonl")) == ["val_greedy_step_0.jsonl",
                                                                             "val_sampled_step_0.jsonl"]
    records = [json.loads(line) for line in (out / "trajectories" / "val_greedy_step_0.jsonl").read_text().splitlines()]
    assert records and all(len(r["turns"]) <= 2 for r in records)  # the run's agent_proxy.max_turn=2
    sampled = (out / "trajectories" / "val_sampled_step_0.jsonl").read_text().splitlines()
    assert len(records) == 2 and len(sampled) == 4  # every episode, past the run's log_trajectories_per_tag=2
    assert (out / "trajectories" / "viewer.html").stat().st_size > 1000
    workers_log = (out / "logs" / "workers.log").read_text()
    started = set(re.findall(r":actor_name:(\w+)", workers_log))
    assert started == {"VLLMEngine", "EnvStateManager"}, started  # no FSDP actor, critic or reference
    console = (proc.stdout + proc.stderr).splitlines()
    assert not [line for line in console for q in QUIET if q.matches(line)]
    assert any(q.matches(line) for line in workers_log.splitlines() for q in QUIET)
