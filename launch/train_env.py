"""``make train-env``: make train's recipe on an environment of your own, one command from the tags file to the
held-out table (docs/writing_an_environment.md, "Train it: the recipe").

    make train-env ENVS=my_envs.yaml TAG=MyEnv [SEED=s] [DEMONSTRATOR=package.module:function] [NOISE=0.25]
    python -m launch.train_env --envs-file my_envs.yaml --tag MyEnv [--seed s] [key=value ...]

Each step is reused when its folder is complete (as make train's are), so a second call with other RL overrides
reruns only RL; delete a folder to redo its step:

1. the model that knows the env: ``launch.build_tiny_model --seed s --add-envs-config <tags file>`` writes
   ``models/tiny-qwen2-<tags file name>-seed<s>`` (the shipped tags and yours in its corpus); ``models/`` and
   ``outputs/`` are under ``--out-dir`` (``OUT``, default this repository);
2. the warm start: SFT on the env's expert (``expert_action``) or on a scripted policy (``--demonstrator``), a
   share ``--noise`` of its moves replaced by random valid actions (``config/sft_env_recipe.yaml``), into
   ``outputs/agent_trainer/sft_env_<tag>_seed<s>``;
3. the warm start's sampled figures (``launch.warm_start_report``);
4. RL: GiGPO from the task's reward alone (``config/env_recipe.yaml``), step 0 validated, into
   ``outputs/agent_trainer/env_<tag>_seed<s>``;
5. the held-out table: the start and the end (greedy, 128 held-out seeds) beside baselines computed by code on the
   same seeds (random valid, the best fixed sequence of actions, the expert when there is one), and
   ``learning_summary.json`` in the RL folder (``bench/baselines.py``).

``SEED`` is the pipeline seed, as in make train: it seeds the model build, the demonstrations and the SFT, and RL.
The turn limit (``agent_proxy.max_turn``) is the tag's ``max_actions_per_traj``. ``key=value`` arguments are
overrides of the RL config, given to RL, to the warm-start figures and to the table.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RL_CONFIG = "env_recipe"
SFT_CONFIG = "sft_env_recipe"
NOISE = 0.25
"""The warm start's share of random valid moves: some mistakes left for RL to find (make train's start is blind)."""
STAMP = "train_env_step.json"
"""Written into a step's folder when it finishes: its command and inputs, so a later call reuses or remakes it."""
WARMUP_STEPS = 1200
"""The model build's warm-up steps with a tags file added (``make model ENVS=``'s ``ENVS_WARMUP``)."""


def inputs_digest(envs_file: Path, tag: str) -> str:
    """A digest of what the model build and the warm start are made from: the tags file and the env's module
    source (an edit to either makes them again)."""
    from envs.registry import load_env_tags

    digest = hashlib.sha256(envs_file.read_bytes())
    module, colon, _ = load_env_tags(envs_file)[tag].env_type.partition(":")  # a registered name has no module here
    if not colon:
        return digest.hexdigest()
    source = envs_file.parent / (module.replace(".", "/") + ".py")  # where the runs import it from first
    if not source.is_file():
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        source = Path(spec.origin) if spec is not None and spec.origin else None
    if source is not None and source.is_file():
        digest.update(source.read_bytes())
    return digest.hexdigest()


def default_noise(envs_file: Path, tag: str) -> float:
    """:data:`NOISE` for an env that lists its actions ("Heat | Chill | Steady"), 0 for one that describes them in
    prose (no list to draw random actions from)."""
    from agent_trainer.agents.demonstrations import valid_actions
    from envs import make_env
    from envs.registry import load_env_tags

    env = make_env(tag, load_env_tags(envs_file))
    try:
        env.reset(seed=0)
        return NOISE if valid_actions(env) else 0.0
    finally:
        env.close()


def reusable(folder: Path, stamp: dict) -> bool:
    """Whether ``folder`` holds a finished step made by the same command from the same inputs."""
    try:
        return json.loads((folder / STAMP).read_text()) == stamp
    except (OSError, ValueError):
        return False


def paths(envs_file: Path, tag: str, seed: int, out_dir: Path = REPO) -> dict[str, Path]:
    """The model folder and the two run folders of one (tags file, tag, pipeline seed), under ``out_dir``."""
    runs = out_dir / "outputs" / "agent_trainer"
    return {"model": out_dir / "models" / f"tiny-qwen2-{envs_file.stem}-seed{seed}",
            "sft": runs / f"sft_env_{tag}_seed{seed}",
            "rl": runs / f"env_{tag}_seed{seed}"}


def tag_overrides(envs_file: Path, tag: str) -> list[str]:
    """The RL config's overrides that point it at ``tag``: the tags file, train and held-out tags, the turn limit.

    Raises ValueError naming the tag and the file's tags when the tag is not in the file."""
    from envs.registry import load_env_tags

    tags = load_env_tags(envs_file)
    if tag not in tags:
        raise ValueError(f"TAG={tag!r} is not a tag of {envs_file} (its tags: {sorted(tags)}); "
                         f"set TAG to one of them")
    return [f"envs_file={envs_file}",
            f"es_manager.train.env_configs.tags=[{tag}]",
            f"es_manager.val.env_configs.tags=[{tag}]",
            f"agent_proxy.max_turn={tags[tag].max_actions_per_traj}"]


def commands(envs_file: Path, tag: str, seed: int, *, demonstrator: str = "expert", noise: float = NOISE,
             warmup_steps: int = WARMUP_STEPS, out_dir: Path = REPO, started_at: float | None = None,
             sft_overrides: list[str] = (),
             rl_overrides: list[str] = ()) -> list[tuple[str, list[str], Path | None]]:
    """The recipe's steps: (name, argv, the folder a reusable step writes, or None for a step that always runs)."""
    py = sys.executable
    where = paths(envs_file, tag, seed, out_dir)
    env = tag_overrides(envs_file, tag)
    model, sft, rl = where["model"], where["sft"], where["rl"]
    rl_args = [*env, f"trainer.seed={seed}", *rl_overrides]
    clock = [] if started_at is None else ["--started-at", str(started_at)]
    return [
        ("the model that knows the env",
         [py, "-m", "launch.build_tiny_model", "--out", str(model), "--seed", str(seed),
          "--warmup-steps", str(warmup_steps), "--add-envs-config", str(envs_file), "--force"],
         model),
        ("the warm start",
         [py, "-m", "agent_trainer.sft", "--config-name", SFT_CONFIG, f"model_path={model}",
          f"rl_overrides=[{','.join(repr(o) for o in env)}]", f"data.demonstrator={demonstrator}",
          f"data.noise={noise}", f"data.seed={seed * 1000}", f"trainer.seed={seed}",
          f"trainer.default_local_dir={sft}", *sft_overrides],
         sft),
        ("the warm start's sampled figures",
         [py, "-m", "launch.warm_start_report", "--config-name", RL_CONFIG, "--model", str(sft / "final"), *rl_args],
         None),
        ("RL",
         [py, "-m", "agent_trainer.main", "--config-name", RL_CONFIG, f"model_path={sft / 'final'}", *rl_args,
          f"trainer.default_local_dir={rl}", "trainer.resume_mode=disable", "trainer.val_before_train=true"],
         None),
        ("the held-out table",
         [py, str(REPO / "bench" / "baselines.py"), "--config-name", RL_CONFIG, "--sft-dir", str(sft),
          "--rl-dir", str(rl), *clock, f"model_path={sft / 'final'}", *rl_args],
         None),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs-file", type=Path, required=True, help="your tags file (ENVS)")
    parser.add_argument("--tag", required=True, help="the tag to train on (TAG)")
    parser.add_argument("--seed", type=int, default=0, help="the pipeline seed (SEED): model build, warm start, RL")
    parser.add_argument("--demonstrator", default="expert",
                        help="the warm start's policy: expert (the env's expert_action) or package.module:function")
    parser.add_argument("--noise", type=float, default=None,
                        help=f"the share of the warm start's moves replaced by random valid actions (default "
                             f"{NOISE} where the env lists its actions, 0 where it describes them in prose)")
    parser.add_argument("--warmup-steps", type=int, default=WARMUP_STEPS,
                        help="the model build's warm-up steps on the corpus with your env (ENVS_WARMUP)")
    parser.add_argument("--sft", action="append", default=[], metavar="KEY=VALUE",
                        help="an override of the warm start's SFT config (config/sft_env_recipe.yaml; SFT_ARGS)")
    parser.add_argument("--out-dir", type=Path, default=REPO,
                        help="where models/ and outputs/agent_trainer/ are written (OUT; default: this repository)")
    parser.add_argument("--started-at", type=float, default=None,
                        help="Unix time the job started (make train-env passes it): wall_s in the summary")
    parser.add_argument("--dry-run", action="store_true", help="print the steps' commands and run none")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the RL config")
    args = parser.parse_args(argv)
    envs_file = args.envs_file.resolve()
    if not envs_file.is_file():
        print(f"ENVS={args.envs_file}: no such file; give the path of your tags file", file=sys.stderr)
        return 2
    if args.noise is not None and not 0.0 <= args.noise <= 1.0:
        print(f"NOISE={args.noise}: must lie in [0, 1] (the share of the warm start's random moves)", file=sys.stderr)
        return 2
    try:
        tag_overrides(envs_file, args.tag)  # an unknown tag is refused first, naming the file's tags
        noise = default_noise(envs_file, args.tag) if args.noise is None else args.noise
        steps = commands(envs_file, args.tag, args.seed, demonstrator=args.demonstrator, noise=noise,
                         warmup_steps=args.warmup_steps, sft_overrides=args.sft, out_dir=args.out_dir.resolve(),
                         started_at=args.started_at if args.started_at is not None else time.time(),
                         rl_overrides=args.overrides)
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    # The tags file's folder on the import path of every step, as `make model ENVS=` puts it (the build imports
    # the env to play it; the runs import it beside the tags file themselves).
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(envs_file.parent), str(REPO), env.get("PYTHONPATH")) if p)
    digest, remade = inputs_digest(envs_file, args.tag), False
    for number, (name, argv_, folder) in enumerate(steps, 1):
        stamp = {"argv": argv_[1:], "inputs": digest}
        if folder is not None and not remade and reusable(folder, stamp):  # a new model makes a new warm start
            print(f"[{number}/{len(steps)}] {name}: reused ({folder})", flush=True)
            continue
        print(f"[{number}/{len(steps)}] {name}: {' '.join(argv_)}", flush=True)
        if args.dry_run:
            continue
        if folder is not None and folder.exists():  # made from other inputs (or cut short): made again
            print(f"    {folder} was made from other inputs or did not finish: made again", flush=True)
            shutil.rmtree(folder)
        remade = remade or folder is not None
        code = subprocess.call(argv_, cwd=REPO, env=env)
        if code:
            print(f"make train-env stopped at step {number} ({name}): exit {code}", file=sys.stderr)
            return code
        if folder is not None:
            (folder / STAMP).write_text(json.dumps(stamp, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
