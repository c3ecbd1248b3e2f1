"""`ray job submit` for real: a head node of its own (loopback, free ports, own temp dir and auth token),
``launch/submit_job.sh`` submits a 2-step FrozenLake run with the runtime env; the job succeeds, writes
its metrics, names its actors in the run's namespace, and nothing of the cluster listens beyond
127.0.0.1. Only this test's cluster is stopped: ``ray stop`` would stop every cluster on the machine."""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
EXPERIMENT = "job_submit_e2e"


@dataclass
class HeadNode:
    """A `ray start --head --block` cluster of this test."""

    process: subprocess.Popen
    dashboard_url: str
    """Where the ray CLI reaches this cluster: jobs, and the state API (``ray list``)."""
    token: str
    env: dict[str, str]
    """Environment under which the ray CLI talks to this cluster (its token, the venv first on PATH)."""
    temp_dir: Path


@dataclass
class ListenerWatch:
    """Listening sockets of a process tree, sampled every second in a background thread."""

    root: int
    seen: set[tuple[str, int, str]] = field(default_factory=set)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.wait(1.0):
            self.seen |= listeners(tree_pids(self.root))


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 (all held open until every one is picked)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def tree_pids(root: int) -> set[int]:
    try:
        proc = psutil.Process(root)
        return {root} | {c.pid for c in proc.children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def listeners(pids: set[int]) -> set[tuple[str, int, str]]:
    """(ip, port, process name) of every listening TCP socket and bound UDP socket of ``pids``."""
    found = set()
    for conn in psutil.net_connections(kind="inet"):
        listening = conn.status == psutil.CONN_LISTEN or (conn.type == socket.SOCK_DGRAM and not conn.raddr)
        if conn.pid in pids and listening and conn.laddr:
            try:
                name = psutil.Process(conn.pid).name()
            except psutil.NoSuchProcess:
                name = "?"
            found.add((conn.laddr.ip, conn.laddr.port, name))
    return found


def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


def wait_for_dashboard(url: str, token: str, process: subprocess.Popen, log: Path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    request = urllib.request.Request(f"{url}/api/version", headers={"Authorization": f"Bearer {token}"})
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"`ray start --head` exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(request, timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1.0)
    raise TimeoutError(f"the dashboard at {url} did not answer within {timeout_s} s:\n{log.read_text()[-3000:]}")


def stop_head(head: HeadNode) -> None:
    """SIGTERM to `ray start --block` stops the processes it started; kill what is still alive after it.

    Leftovers (the dashboard and autoscaler processes may still be exiting) are found as descendants of
    the head process (collected before it stops) or by this cluster's temp dir on their command line;
    nothing else on the machine is touched.
    """
    pids = tree_pids(head.process.pid) - {head.process.pid}
    head.process.terminate()
    try:
        head.process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        head.process.kill()
        head.process.wait()
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if str(head.temp_dir) in " ".join(proc.info["cmdline"] or []):
            pids.add(proc.info["pid"])
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in procs:
            try:
                proc.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        _, procs = psutil.wait_procs(procs, timeout=10)


@pytest.fixture
def head_node(tmp_path):
    temp_dir = Path(tempfile.mkdtemp(prefix="rayjob-", dir="/tmp"))  # short: Ray's socket paths are limited
    token = secrets.token_hex(32)
    token_file = tmp_path / "auth_token"
    token_file.write_text(token)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update({
        "PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # a single-node cluster on 127.0.0.1 (as init_ray does)
        "RAY_AUTH_MODE": "token",  # this cluster's own token, not ~/.ray/auth_token
        "RAY_AUTH_TOKEN_PATH": str(token_file),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_worker_niceness": "0",  # the job's workers at normal priority, as a local run has them (docs/cluster.md)
    })
    (gcs, dash, agent_http, agent_grpc, metrics, runtime_env_agent, node_manager, object_manager, client,
     dashboard_metrics, autoscaler_metrics) = free_ports(11)
    # these two default to fixed ports (44227, 44217) that another cluster on the machine may hold
    env.update({"DASHBOARD_METRIC_PORT": str(dashboard_metrics), "AUTOSCALER_METRIC_PORT": str(autoscaler_metrics)})
    cmd = ["ray", "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs}",
           "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
           f"--dashboard-agent-listen-port={agent_http}", f"--dashboard-agent-grpc-port={agent_grpc}",
           f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={runtime_env_agent}",
           f"--node-manager-port={node_manager}", f"--object-manager-port={object_manager}",
           f"--ray-client-server-port={client}", f"--temp-dir={temp_dir}", "--num-cpus=2", "--disable-usage-stats"]
    log_path = tmp_path / "ray_start.log"
    log = log_path.open("w")
    process = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    head = HeadNode(process, f"http://127.0.0.1:{dash}", token, env, temp_dir)
    try:
        wait_for_dashboard(head.dashboard_url, token, process, log_path)
        yield head
    finally:
        stop_head(head)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def ray_cli(head: HeadNode, *args: str) -> str:
    proc = subprocess.run(["ray", *args], env=head.env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def test_submit_frozenlake_job(head_node, tiny_model_path, tmp_path):
    head, run_dir, job_id = head_node, tmp_path / "run", f"frozenlake_{secrets.token_hex(4)}"
    # Token auth: the job API refuses a request without the cluster's token.
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{head.dashboard_url}/api/jobs/", timeout=10)
    assert refused.value.code in (401, 403)

    watch = ListenerWatch(head.process.pid)
    watcher = threading.Thread(target=watch.run, daemon=True)
    watcher.start()
    submit = subprocess.run(
        [str(REPO / "launch" / "submit_job.sh"), "--config-name", "frozenlake",
         f"model_path={Path(tiny_model_path).resolve()}", f"trainer.default_local_dir={run_dir}",
         f"trainer.experiment_name={EXPERIMENT}", "trainer.total_training_steps=2", "trainer.test_freq=0",
         "trainer.progress_bar=false", "agent_proxy.max_turn=2", "es_manager.train.env_groups=2",
         "es_manager.train.env_configs.n_groups=[2]", "ppo_mini_batch_size=8",
         "actor_rollout_ref.rollout.response_length=16", "actor_rollout_ref.rollout.name=hf"],
        env={**head.env, "RAY_ADDRESS": head.dashboard_url, "PYTHON": sys.executable,
             "RAY_JOB_ARGS": f"--submission-id {job_id}"},
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    watch.stop.set()
    watcher.join()
    assert submit.returncode == 0, submit.stdout[-4000:] + submit.stderr[-2000:]

    jobs = json.loads(ray_cli(head, "list", "jobs", "--address", head.dashboard_url, "--format", "json",
                              "--filter", f"submission_id={job_id}"))
    assert [j["status"] for j in jobs] == ["SUCCEEDED"], jobs
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all("actor/pg_loss" in r and "critic/vf_loss" in r for r in records)

    actors = json.loads(ray_cli(head, "list", "actors", "--address", head.dashboard_url, "--format", "json",
                                "--limit", "1000"))
    names = {a["name"]: a["ray_namespace"] for a in actors if a.get("name")}
    expected = {"actor_rank0", "actor_rank1", "rollout_0", "env_train_0", "env_train_1"}
    assert expected <= set(names), sorted(names)
    assert "critic_rank0" not in names  # the critic trained (vf_loss above) inside the actor ranks (critic.colocate)
    assert not any(n.startswith("env_val_") for n in names), sorted(names)  # test_freq=0: no val env actors
    namespaces = {names[n] for n in expected}
    assert len(namespaces) == 1 and namespaces.pop().startswith(f"agent_trainer.{EXPERIMENT}."), names

    exposed = sorted(entry for entry in watch.seen if not is_loopback(entry[0]))
    assert watch.seen and not exposed, exposed
