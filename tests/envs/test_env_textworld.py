"""TextWorld over locally generated games, and the ALFWorld adapter's errors."""

import pytest

import envs

pytest.importorskip("textworld")

TW = {"num_games": 2, "world_size": 2, "nb_objects": 4, "quest_length": 2}


@pytest.fixture(scope="module")
def tw_cache(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("tw_games"))
    env = envs.make_env("textworld", cache_dir=cache, **TW)
    for seed in range(TW["num_games"]):
        env.reset(seed=seed)  # generate the pool once for the module
    env.close()
    return cache


def test_same_seed_same_game(tw_cache):
    a = envs.make_env("textworld", cache_dir=tw_cache, **TW)
    b = envs.make_env("textworld", cache_dir=tw_cache, **TW)
    assert a.reset(seed=0) == b.reset(seed=2) == a.reset(seed=0)  # 2 % num_games == 0
    assert a.reset(seed=0) != a.reset(seed=1)
    assert "Available actions:" in a.render() and "-= " in a.render()


def test_expert_wins_every_game(tw_cache):
    env = envs.make_env("textworld", cache_dir=tw_cache, **TW)
    for seed in range(TW["num_games"]):
        env.reset(seed=seed)
        total = 0.0
        for _ in range(20):
            _, reward, done, info = env.step(env.expert_action())
            total += reward
            if done:
                break
        assert info["success"] and total >= 1.0
        assert "RESTART" not in env.render()


def test_garbage_commands_never_raise_or_reach_the_game(tw_cache, garbage_actions, fuzz):
    env = envs.make_env("textworld", cache_dir=tw_cache, **TW)
    fuzz(env, garbage_actions)
    obs = env.reset(seed=0)
    _, reward, done, info = env.step("  TAKE   the moon ")
    assert (reward, done, info["action_is_valid"]) == (0.0, False, False) and env.render() == obs
    cmd = env.admissible[0]
    assert env.step(f"  {cmd.upper()}. ")[3]["action_is_valid"]


def test_alfworld_without_package_or_data_says_how_to_get_it(tmp_path):
    with pytest.raises((ImportError, FileNotFoundError), match="alfworld-download"):
        envs.make_env("alfworld", data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="split must be one of"):
        envs.make_env("alfworld", split="test")


def test_a_missing_alfworld_package_is_one_line_where_a_corpus_build_skips_it(tmp_path, caplog):
    """The tiny model's corpus goes over every shipped tag; one without its optional package is skipped in one
    warning line (six lines before: the data how-to's block)."""
    import importlib.util
    import logging

    from launch.build_tiny_model import collect_corpus

    if importlib.util.find_spec("alfworld") is not None:
        pytest.skip("the alfworld package is installed: nothing is skipped")
    with pytest.raises(ImportError) as err:
        envs.make_env("alfworld", data_dir=str(tmp_path))
    assert "\n" not in str(err.value) and "pip install 'agent-trainer[alfworld]'" in str(err.value)
    (tmp_path / "tags.yaml").write_text("Lake:\n  env_type: frozen_lake\nALFWorld:\n  env_type: alfworld\n")
    with caplog.at_level(logging.WARNING):
        corpus = collect_corpus(tmp_path / "tags.yaml", n_seeds=1, n_steps=1)
    assert corpus.tags_used == ["Lake"] and list(corpus.tags_skipped) == ["ALFWorld"]
    [warning] = [r.getMessage() for r in caplog.records if "skipping env tag ALFWorld" in r.getMessage()]
    assert "\n" not in warning, warning
