"""Expert demonstrations: they replay to success, and their SFT mask is the RL rollout's mask."""

from __future__ import annotations

import json

import pytest

from agent_trainer.agents.ctx_manager import ContextManager
from agent_trainer.agents.demonstrations import (DemoEpisode, check_demo_tags, check_messages, encode_conversation,
                                                 play_demonstrations, read_jsonl, reply_text, resolve_demonstrator,
                                                 write_jsonl)
from agent_trainer.episode.es_manager import EnvStateManager, EpisodeSpec
from envs import load_env_tags, make_env
from envs.experts import sokoban_solve

from tests.agent_trainer.conftest import play

TAGS = load_env_tags()


@pytest.fixture(scope="module")
def ctx_mgr(tokenizer):
    return ContextManager(tokenizer, max_model_len=1536)


def _play(ctx_mgr, tag: str, seeds, noise: float = 0.0, noise_seed: int = 0, max_turn: int | None = None):
    max_turn = max_turn or TAGS[tag].max_actions_per_traj
    return play_demonstrations(ctx_mgr, TAGS, [DemoEpisode(tag, s) for s in seeds], max_turn=max_turn,
                               turn_budget={tag: 64}, noise=noise, noise_seed=noise_seed)


def _replay(tag: str, seed: int, actions: list[str]) -> bool:
    """Play ``actions`` in a fresh env of ``tag``; True when the episode ends in success."""
    env = make_env(tag, TAGS)
    env.reset(seed=seed)
    info = {}
    for action in actions:
        _, _, done, info = env.step(action)
        if done:
            break
    return bool(info.get("success", False))


@pytest.mark.parametrize("tag", ["FrozenLake3x3", "FrozenLake", "FrozenLakeDescribed"])
def test_frozenlake_demonstrations_replay_to_success(ctx_mgr, tag):
    demos = _play(ctx_mgr, tag, range(40))
    assert all(d.success and all(d.expert) for d in demos)
    assert all(_replay(tag, d.seed, d.actions) for d in demos)
    assert len({tuple(d.actions) for d in demos}) > 1  # the expert reads the map: different maps, different paths


def test_sokoban_demonstrations_replay_to_success_within_the_action_budget(ctx_mgr):
    """Every room whose shortest solution fits in max_actions_per_traj is solved, in that many moves."""
    tag = "SimpleSokoban"
    budget = TAGS[tag].max_actions_per_traj
    demos = _play(ctx_mgr, tag, range(30))
    solvable = 0
    for d in demos:
        env = make_env(tag, TAGS)
        env.reset(seed=d.seed)
        shortest = sokoban_solve(env.walls, env.targets, env.boxes, env.player)
        if len(shortest) <= budget:
            solvable += 1
            assert d.success and len(d.actions) == len(shortest), (d.seed, d.actions, shortest)
            assert _replay(tag, d.seed, d.actions)
        else:
            assert not d.success and len(d.actions) == budget
    assert solvable >= 15


@pytest.mark.parametrize("tag,noise", [("FrozenLake3x3", 0.0), ("FrozenLake3x3", 0.5), ("SimpleSokoban", 0.3)])
def test_sft_mask_equals_rl_mask(tokenizer, ctx_mgr, tag, noise):
    """Encode each demonstration's messages for SFT; play its replies through the RL turn loop; compare."""
    demos = _play(ctx_mgr, tag, range(6), noise=noise, max_turn=6)
    manager = EnvStateManager(TAGS, [EpisodeSpec(env_id=i, group_id=i, tag=tag) for i in range(len(demos))])
    replies = {i: [m["content"] for m in d.messages if m["role"] == "assistant"] for i, d in enumerate(demos)}
    rl = play(tokenizer, ContextManager(tokenizer, max_model_len=1536), manager,
              {i: d.seed for i, d in enumerate(demos)}, replies, max_turn=6, response_length=64)
    for i, demo in enumerate(demos):
        ids, mask = encode_conversation(ctx_mgr, demo.messages)
        episode = rl.episodes[i]
        assert ids == episode.token_ids
        assert mask == episode.response_mask
        assert len(rl.generated[i]) == len(replies[i])  # the RL episode ended where the demonstration did
        # mask 1 exactly on each reply's ids and its eos, in order
        spans, run = [], []
        for token, m in zip(ids, mask):
            if m:
                run.append(token)
            elif run:
                spans.append(run)
                run = []
        spans += [run] if run else []
        assert spans == rl.generated[i]
        assert all(s[-1] == tokenizer.eos_token_id for s in spans)


def test_noise_replaces_that_share_of_actions_reproducibly(ctx_mgr):
    demos = _play(ctx_mgr, "FrozenLake3x3", range(60), noise=0.3, noise_seed=1, max_turn=6)
    flags = [e for d in demos for e in d.expert]
    assert 0.2 < 1 - sum(flags) / len(flags) < 0.4
    assert sum(d.success for d in demos) < len(demos)  # an imperfect warm start
    again = _play(ctx_mgr, "FrozenLake3x3", range(60), noise=0.3, noise_seed=1, max_turn=6)
    other = _play(ctx_mgr, "FrozenLake3x3", range(60), noise=0.3, noise_seed=2, max_turn=6)
    assert [d.actions for d in again] == [d.actions for d in demos]
    assert [d.actions for d in other] != [d.actions for d in demos]
    assert not any(e for d in _play(ctx_mgr, "FrozenLake3x3", range(5), noise=1.0, max_turn=6) for e in d.expert)


def test_a_reply_the_policy_could_not_generate_is_refused(ctx_mgr):
    with pytest.raises(ValueError, match="may generate at most 5"):
        play_demonstrations(ctx_mgr, TAGS, [DemoEpisode("FrozenLake3x3", 0)], max_turn=2,
                            turn_budget={"FrozenLake3x3": 5})


def test_tags_without_an_expert_are_refused():
    check_demo_tags(["FrozenLake3x3", "SimpleSokoban"], TAGS)
    tags = {**TAGS, "Cliff": {"env_type": "gymnasium", "max_actions_per_traj": 5, "env_instruction": "Walk."}}
    with pytest.raises(ValueError, match="'Cliff' .* has no expert solver"):
        check_demo_tags(["Cliff"], tags)
    with pytest.raises(ValueError, match="'Nope' is not an env tag"):
        check_demo_tags(["Nope"], TAGS)


def test_noise_needs_a_list_of_actions(ctx_mgr):
    with pytest.raises(ValueError, match="needs a list of valid actions"):
        play_demonstrations(ctx_mgr, TAGS, [DemoEpisode("Countdown", 0)], max_turn=1, turn_budget={"Countdown": 64},
                            noise=0.5)


def test_a_prose_action_tag_draws_noise_from_the_listed_actions(ctx_mgr):
    """GuessNumber describes its actions in prose: noise draws from data.noise_actions, taken as given."""
    check_demo_tags(["GuessNumber"], TAGS, noise_actions=["1", "2", "99"])
    demos = play_demonstrations(ctx_mgr, TAGS, [DemoEpisode("GuessNumber", s) for s in range(6)], max_turn=3,
                                turn_budget={"GuessNumber": 64}, noise=1.0, noise_actions=["1", "2", "99"])
    assert {a for d in demos for a in d.actions} <= {"1", "2", "99"} and not any(e for d in demos for e in d.expert)


def test_a_noting_reply_thinks_the_observation_it_answers_or_the_envs_note(ctx_mgr):
    """think="note": GuessNumber (no note()) thinks the observation it answers, noisy turns too; FrozenLake thinks
    its note() ("Down: ice, Right: hole.")."""
    demos = play_demonstrations(ctx_mgr, TAGS, [DemoEpisode("GuessNumber", s) for s in range(4)], max_turn=4,
                                turn_budget={"GuessNumber": 64}, noise=0.5, noise_actions=["1", "99"], think="note")
    for demo in demos:
        observations = [m["content"].split("Observation:\n")[1].split("\n")[0] for m in demo.messages
                        if m["role"] == "user"]
        replies = [m["content"] for m in demo.messages if m["role"] == "assistant"]
        assert replies and all(r == f"<think>{o}</think><answer>{a}</answer>"
                               for r, o, a in zip(replies, observations, demo.actions))
    assert not all(e for d in demos for e in d.expert)  # noisy turns note as well
    [lake] = play_demonstrations(ctx_mgr, TAGS, [DemoEpisode("FrozenLakeNoDeadEnds", 3)], max_turn=2,
                                 turn_budget={"FrozenLakeNoDeadEnds": 64}, think="note")
    assert all(m["content"].startswith("<think>Down: ") for m in lake.messages if m["role"] == "assistant")


def test_an_episode_cut_by_max_turn_ends_with_its_last_observation(ctx_mgr):
    demo = _play(ctx_mgr, "FrozenLake", [0], max_turn=2)[0]
    assert not demo.success and [m["role"] for m in demo.messages][-2:] == ["assistant", "user"]
    ids, mask = encode_conversation(ctx_mgr, demo.messages)
    assert ids == demo.token_ids and mask[-1] == 0


def test_jsonl_round_trip(ctx_mgr, tmp_path):
    demos = _play(ctx_mgr, "FrozenLake3x3", range(3), noise=0.5)
    path = write_jsonl(demos, tmp_path / "demos.jsonl")
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["actions"] for r in records] == [d.actions for d in demos]
    assert read_jsonl(path) == [d.messages for d in demos]
    assert all(encode_conversation(ctx_mgr, m)[0] == d.token_ids for m, d in zip(read_jsonl(path), demos))


@pytest.mark.parametrize("messages,match", [
    ([], "non-empty list"),
    ([{"role": "user", "content": "hi"}], "at least one assistant"),
    ([{"role": "assistant", "content": "a"}], "starting with user"),
    ([{"role": "user", "content": "u"}, {"role": "user", "content": "u"}], "alternating"),
    ([{"role": "user", "content": "u"}, {"role": "assistant", "content": 3}], "message 1"),
    ([{"role": "tool", "content": "u"}, {"role": "assistant", "content": "a"}], "message 0"),
])
def test_malformed_conversations_are_refused(messages, match):
    with pytest.raises(ValueError, match=match):
        check_messages(messages)


def test_malformed_jsonl_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": reply_text("Down")}]}
    path.write_text(json.dumps(good) + "\n" + "{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:2: not a JSON object"):
        read_jsonl(path)


def test_a_custom_system_prompt_keeps_the_reply_mask(ctx_mgr, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Go?"},
                {"role": "assistant", "content": reply_text("Down")}, {"role": "user", "content": "Again?"},
                {"role": "assistant", "content": reply_text("Right")}]
    ids, mask = encode_conversation(ctx_mgr, messages)
    text = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert text == reply_text("Down") + "<|im_end|>" + reply_text("Right") + "<|im_end|>"
    assert tokenizer.decode(ids).startswith("<|im_start|>system\nBe brief.<|im_end|>")



def test_a_format_only_start_replies_in_format_with_only_the_configured_actions(ctx_mgr, tokenizer):
    """noise 1.0 + noise_actions [Down, Right]: every reply is the answer format around one of the two moves, so
    the warm start learns the format and the goal's rough direction, nothing about the maps."""
    demos = play_demonstrations(ctx_mgr, TAGS, [DemoEpisode("FrozenLakeNoDeadEnds", s) for s in range(12)],
                                max_turn=6, turn_budget={"FrozenLakeNoDeadEnds": 64}, noise=1.0,
                                noise_actions=["Down", "Right"])
    actions = [a for d in demos for a in d.actions]
    assert set(actions) == {"Down", "Right"} and not any(e for d in demos for e in d.expert)
    replies = [m["content"] for d in demos for m in d.messages if m["role"] == "assistant"]
    assert replies == [reply_text(a) for a in actions]


def test_noise_actions_outside_the_tags_actions_are_refused():
    with pytest.raises(ValueError, match=r"data.noise_actions = \['Down', 'Jump'\]: \['Jump'\] not among"):
        check_demo_tags(["FrozenLake3x3"], TAGS, noise_actions=["Down", "Jump"])


def test_a_scripted_demonstrator_reads_the_map_with_its_own_aim(ctx_mgr):
    """envs.frozen_lake:step_into_holes steps onto an adjacent Down/Right hole whenever there is one."""
    demonstrator = resolve_demonstrator("envs.frozen_lake:step_into_holes")
    demos = play_demonstrations(ctx_mgr, TAGS, [DemoEpisode("FrozenLakeNoDeadEnds", s) for s in range(16)],
                                max_turn=6, turn_budget={"FrozenLakeNoDeadEnds": 64}, demonstrator=demonstrator)
    for demo in demos:
        env = make_env("FrozenLakeNoDeadEnds", TAGS)
        env.reset(seed=demo.seed)
        for action in demo.actions:
            row, col = env.position
            below = row + 1 < len(env.desc) and env.desc[row + 1][col] == "H"
            right = col + 1 < len(env.desc) and env.desc[row][col + 1] == "H"
            assert action in ("Down", "Right")
            if below:
                assert action == "Down"
            elif right:
                assert action == "Right"
            env.step(action)


def test_the_careless_walker_is_blind_to_holes_and_stays_on_the_map(ctx_mgr):
    """envs.frozen_lake:careless_walker (make train's warm start): Down or Right, never off the map, and where one
    of them is a hole it takes the hole about half the time, whichever side the hole is on."""
    demonstrator = resolve_demonstrator("envs.frozen_lake:careless_walker")
    demos = play_demonstrations(ctx_mgr, TAGS, [DemoEpisode("FrozenLakeNoDeadEnds", s) for s in range(400)],
                                max_turn=6, turn_budget={"FrozenLakeNoDeadEnds": 64}, demonstrator=demonstrator)
    forks = {"Down": [], "Right": []}  # per side of the hole: 1 when the walker stepped onto it
    for demo in demos:
        env = make_env("FrozenLakeNoDeadEnds", TAGS)
        env.reset(seed=demo.seed)
        for action in demo.actions:
            row, col = env.position
            size = len(env.desc)
            assert action in ("Down", "Right")
            assert (row + 1 < size) if action == "Down" else (col + 1 < size), (demo.seed, demo.actions)
            if row + 1 < size and col + 1 < size and (env.desc[row + 1][col] == "H") != (env.desc[row][col + 1] == "H"):
                side = "Down" if env.desc[row + 1][col] == "H" else "Right"
                forks[side].append(int(action == side))
            env.step(action)
    for side, chose in forks.items():
        assert len(chose) > 40 and 0.35 < sum(chose) / len(chose) < 0.65, (side, len(chose), sum(chose))


def test_the_noting_walkers_note_the_tiles_beside_them_in_the_reply(ctx_mgr):
    """envs.frozen_lake:noting_walker and hole_noting_walker: the reply's think copies what lies Down and Right (the
    surroundings line's words); the first moves blindly, the second onto a noted hole three times in four."""
    for name, low, high in (("noting_walker", 0.35, 0.65), ("hole_noting_walker", 0.65, 0.85)):
        demonstrator = resolve_demonstrator(f"envs.frozen_lake:{name}")
        demos = play_demonstrations(ctx_mgr, TAGS, [DemoEpisode("FrozenLakeNoDeadEnds", s) for s in range(400)],
                                    max_turn=6, turn_budget={"FrozenLakeNoDeadEnds": 64}, demonstrator=demonstrator)
        chose = []
        for demo in demos:
            env = make_env("FrozenLakeNoDeadEnds", TAGS)
            observation = env.reset(seed=demo.seed)
            replies = [m["content"] for m in demo.messages if m["role"] == "assistant"]
            for action, reply in zip(demo.actions, replies):
                line = next(x for x in observation.splitlines() if x.startswith("The goal is "))
                down, right = (w.split(": ")[1] for w in line.rstrip(".").split(". ")[1].split(", ")[1:3])
                assert reply == f"<think>Down: {down}, Right: {right}.</think><answer>{action}</answer>"
                if {down, right} == {"hole", "ice"}:
                    chose.append(int((down if action == "Down" else right) == "hole"))
                observation, *_ = env.step(action)
        assert len(chose) > 100 and low < sum(chose) / len(chose) < high, (name, len(chose), sum(chose))


@pytest.mark.parametrize("name, match", [
    ("envs.frozen_lake:no_such_policy", "could not be imported"),
    ("nobody", "neither expert nor an import path"),
    ("envs.frozen_lake:ACTIONS", "is not callable"),
])
def test_a_bad_demonstrator_is_refused_naming_the_key(name, match):
    with pytest.raises(ValueError, match=rf"data.demonstrator = {name!r} .*{match}"):
        resolve_demonstrator(name)
