"""The cost of serving an env over HTTP: FrozenLake episodes per second in-process against the same tag served by
``python -m agent_trainer.serve_env`` and played through the ``openenv`` env tag (a session per episode), on the same
seeds and actions, alternated in one process (benchmark of docs/benchmarks.md, not a test).

Each round plays ``--episodes`` episodes of the shipped FrozenLake tag (seeded random moves, at most 10 each) with
one env object, in-process and then through the server on 127.0.0.1 started here; medians over ``--rounds`` rounds
after a warm-up. Writes ``openenv.json`` to a results folder (``bench/results/<UTC stamp>`` unless ``--out``).

    python bench/bench_openenv.py [--episodes 200] [--rounds 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from results import results_dir  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MOVES = ["Left", "Down", "Right", "Up"]


def play(env, episodes: int) -> tuple[float, int]:
    """Seconds for ``episodes`` seeded episodes, and the steps they took."""
    rng, steps = random.Random(0), 0
    start = time.perf_counter()
    for seed in range(episodes):
        env.reset(seed=seed)
        for _ in range(10):
            steps += 1
            if env.step(rng.choice(MOVES))[2]:
                break
    return time.perf_counter() - start, steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import envs
    import httpx
    from envs.registry import load_env_tags

    key = secrets.token_hex(16)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env_vars = {**os.environ, "AGENT_TRAINER_ENV_KEY": key, "BENCH_OPENENV_KEY": key}
    os.environ["BENCH_OPENENV_KEY"] = key
    server = subprocess.Popen([sys.executable, "-m", "agent_trainer.serve_env", "--envs-file", "config/envs.yaml",
                               "--tag", "FrozenLake", "--port", str(port)], cwd=REPO, env=env_vars,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(url + "/health", headers={"Authorization": f"Bearer {key}"}).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        tags = dict(load_env_tags(REPO / "config" / "envs.yaml"))
        served = {"env_type": "openenv", "max_actions_per_traj": 10, "env_instruction": "", "max_tokens": 100,
                  "env_config": {"base_url": url, "api_key_env": "BENCH_OPENENV_KEY"}}
        remote = envs.make_env("FrozenLakeServed", {**tags, "FrozenLakeServed": served})
        local = envs.make_env("FrozenLake", tags)
        play(local, 10), play(remote, 10)  # warm-up
        rounds = [(play(local, args.episodes), play(remote, args.episodes)) for _ in range(args.rounds)]
        remote.close()
    finally:
        server.kill()
    steps = rounds[0][0][1]
    local_s = statistics.median(r[0][0] for r in rounds)
    remote_s = statistics.median(r[1][0] for r in rounds)
    result = {"episodes": args.episodes, "steps": steps, "rounds": args.rounds,
              "in_process": {"seconds": local_s, "episodes_per_s": args.episodes / local_s},
              "openenv": {"seconds": remote_s, "episodes_per_s": args.episodes / remote_s},
              "http_ms_per_step": 1000 * (remote_s - local_s) / (steps + args.episodes)}
    out = Path(args.out) if args.out else results_dir()
    out.mkdir(parents=True, exist_ok=True)
    (out / "openenv.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
