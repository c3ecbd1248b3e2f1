"""Trajectory JSONL and the static viewer, looked at the way a person would: in a real headless Chromium.

The episodes are played by a real ``EnvStateManager`` (FrozenLake and Bandit) through the real
context managers (``conftest.play``); only the replies are scripted.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from agent_trainer.agents.condensed_ctx import CondensedContextManager
from agent_trainer.agents.ctx_manager import ContextManager
from agent_trainer.episode.es_manager import EpisodeState
from agent_trainer.observe.trajectories import EpisodeRecord, read_records, row_spans, sample_states, write_step
from agent_trainer.observe.viewer import embed_json, render_html

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


def chromium() -> str:
    """The system Chromium, or skip naming the package (``make test`` installs it when it is root)."""
    for name in CHROMIUM_NAMES:
        if path := shutil.which(name):
            return path
    pytest.skip("no Chromium on PATH: `apt-get install chromium` (make test installs it when run as root)")


def headless(*args: str, timeout: float = 120.0) -> str:
    """Run headless Chromium (no sandbox: tests may run as root) and return its stdout."""
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--virtual-time-budget=5000", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=True).stdout


def _played_step(tokenizer, play_mixed, manager, ctx_mgr, tmp_path: Path) -> Path:
    played = play_mixed(ctx_mgr)
    batch = ctx_mgr.build_update_batch([played.episodes[k] for k in sorted(played.episodes)])
    # a visible advantage pattern on the generated tokens: positive for even episodes, negative for odd
    sign = torch.where(batch["traj_uid"] % 2 == 0, 1.0, -1.0)[:, None]
    batch["advantages"] = sign * batch["response_mask"].float() * torch.linspace(0.1, 1.0, batch["input_ids"].shape[1])
    return write_step(tmp_path, 3, "train", manager.get_rollout_states(), batch, tokenizer, per_tag=2)


@pytest.mark.parametrize("layout", [ContextManager, CondensedContextManager])
def test_jsonl_turns_join_env_history_and_tokens(tokenizer, play_mixed, mixed_manager, tmp_path, layout):
    path = _played_step(tokenizer, play_mixed, mixed_manager, layout(tokenizer, max_model_len=4096), tmp_path)
    assert path == tmp_path / "trajectories" / "step_3.jsonl"
    records = [EpisodeRecord.from_json(line) for line in path.read_text().splitlines()]
    assert sorted((r.tag, r.env_id) for r in records) == [("Bandit", 2), ("Bandit", 3),
                                                        ("FrozenLake3x3", 0), ("FrozenLake3x3", 1)]
    lake = next(r for r in records if r.env_id == 0)
    assert len(lake.turns) == 4 and lake.turns[0].actions == ["Left"] and lake.turns[-1].done
    for turn in lake.turns:
        generated = "".join(t for t, m in zip(turn.tokens, turn.mask) if m)
        assert generated.startswith(turn.reply), (generated, turn.reply)  # the reply text, then eos
        assert all(a > 0 for a, m in zip(turn.advantage, turn.mask) if m)
        assert all(a == 0 for a, m in zip(turn.advantage, turn.mask) if not m)
        assert "\n" in turn.observation  # FrozenLake's observation is a grid
    assert lake.turns[0].prompt and "<|im_start|>" in lake.turns[0].prompt
    assert all(a < 0 for t in next(r for r in records if r.env_id == 3).turns for a, m in zip(t.advantage, t.mask) if m)
    bandit = next(r for r in records if r.env_id == 2)
    assert bandit.turns[0].reward == bandit.total_reward
    assert read_records(path.parent) == sorted(records, key=lambda r: (r.step, r.split, r.tag, r.env_id))


def test_sample_keeps_successes_and_failures_per_tag():
    states = [EpisodeState(env_id=i, group_id=i, tag=t, history=[], penalty=0.0, final_observation="",
                           metrics={"success": float(i % 3 == 0)}) for i, t in enumerate(["A"] * 6 + ["B"] * 3)]
    picked = sample_states(states, per_tag=2)
    assert [(s.tag, s.metrics["success"]) for s in picked] == [("A", 1.0), ("A", 0.0), ("B", 1.0), ("B", 0.0)]
    assert [s.env_id for s in sample_states(states, per_tag=5) if s.tag == "B"] == [6, 7, 8]
    assert row_spans([0, 0, 1, 1, 0, 1, 0]) == [(range(0, 2), range(2, 4)), (range(4, 5), range(5, 6)),
                                                (range(6, 7), range(7, 7))]


def test_embedded_data_cannot_close_the_script_element():
    hostile = {"reply": "</script><script>alert(1)</script><!-- \u2028"}
    assert "<" not in embed_json(hostile) and json.loads(embed_json(hostile)) == hostile
    page = render_html([hostile])
    assert page.count("</script>") == 2 and "http" not in page  # the two own script elements; nothing fetched


def test_a_person_sees_turns_highlighted_tokens_and_rewards_in_chromium(tokenizer, play_mixed, mixed_manager,
                                                                        tmp_path):
    path = _played_step(tokenizer, play_mixed, mixed_manager, ContextManager(tokenizer, max_model_len=4096),
                        tmp_path)
    viewer = path.parent / "viewer.html"
    dom = headless("--dump-dom", viewer.as_uri())
    # the first episode in the list is shown: FrozenLake3x3 env 0 (tags sort Bandit first, so the list has 4)
    assert dom.count('<button class="current"') == 1 and len(re.findall(r"<nav.*?</nav>", dom, re.S)) == 1
    assert len(re.findall(r"train 3 · \w+", dom)) == 4
    shown = re.search(r'<section id="episode">(.*)</section>', dom, re.S).group(1)
    assert "Bandit · env 2" in shown and "success" in shown
    assert re.search(r"Turn 1 · <span class=\"reward\">reward \d\.\d{3}</span>", shown)
    gen = re.findall(r'<span class="tok gen" data-mask="1"[^>]*data-advantage="([-\d.e]+)"', shown)
    assert gen and all(float(a) > 0 for a in gen)  # env 2 is even: green
    assert "background: rgba(30, 160, 60" in shown and 'class="tok prompt"' in shown
    assert "Dragon" in shown  # the reply text
    shot = tmp_path / "viewer.png"
    headless("--window-size=1200,900", f"--screenshot={shot}", viewer.as_uri())
    assert shot.stat().st_size > 10_000


def test_an_evaluation_pass_label_is_written_and_read_back(tokenizer, play_mixed, mixed_manager, tmp_path):
    """``python -m agent_trainer.eval`` writes passes labelled val_greedy / val_pass@k beside the rollout splits;
    the folder's records (and so its viewer) read them back."""
    ctx_mgr = ContextManager(tokenizer, max_model_len=4096)
    played = play_mixed(ctx_mgr)
    batch = ctx_mgr.build_update_batch([played.episodes[k] for k in sorted(played.episodes)])
    states = mixed_manager.get_rollout_states()
    write_step(tmp_path, 0, "val_greedy", states, batch, tokenizer, per_tag=1)
    path = write_step(tmp_path, 0, "val_pass@2", states, batch, tokenizer, per_tag=1)
    assert path.name == "val_pass@2_step_0.jsonl"
    assert {r.split for r in read_records(path.parent)} == {"val_greedy", "val_pass@2"}


def _gateway_step(tokenizer, tmp_path: Path) -> tuple[Path, list[list[int]]]:
    """A gateway episode of 3 calls and 2 env steps, as GatewayRollout hands it to the trajectories: call 1's reply
    has no action, the agent asks again (call 2, which leads to step 1), then call 3 leads to step 2."""
    from agent_trainer.episode.es_manager import EnvTurn
    from agent_trainer.gateway.sessions import CallRecord
    from agent_trainer.agents.gateway import GatewayAgent, GatewayEpisode

    ids = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    replies = [ids("I am not sure.") + [tokenizer.eos_token_id], ids("<answer>Left</answer>"),
               ids("<answer>Down</answer>")]
    prompt, records = ids("Walk to the goal."), []
    for k, reply in enumerate(replies):
        records.append(CallRecord(request_index=k, choice_index=0, prompt_ids=tuple(prompt), completion_ids=tuple(reply),
                                  logprobs=tuple(-0.5 for _ in reply), finish_reason="stop", policy_version=0))
        prompt = prompt + reply + ids(f" Observation {k + 1}. Reply as <answer>...</answer>.")
    episode = GatewayEpisode(env_id=5, group_id=0, tag="FrozenLake3x3", instruction="", observation="grid 0", anchor=1,
                             records=records, steps=[(2, 0.0, 2), (3, 1.0, 3)])
    episode.finish()
    assert len(episode.rows) == 1  # the calls continue each other: one row
    batch = GatewayAgent(tokenizer).build_update_batch([episode])
    history = [EnvTurn(observation="grid 0", llm_response="<answer>Left</answer>", actions=["Left"], reward=0.0,
                       info={}),
               EnvTurn(observation="grid 1", llm_response="<answer>Down</answer>", actions=["Down"], reward=1.0,
                       info={})]
    state = EpisodeState(env_id=5, group_id=0, tag="FrozenLake3x3", history=history, penalty=0.0,
                         final_observation="grid 2", metrics={"success": 1.0, "num_turns": 2.0, "gateway_rows": 1.0,
                                                              "gateway_breaks": 0.0},
                         turn_replies=episode.step_calls())
    return write_step(tmp_path, 1, "train", [state], batch, tokenizer, per_tag=1), replies


def test_a_gateway_episode_shows_every_call_with_the_env_step_it_led_to(tokenizer, tmp_path):
    """Turns are keyed by call: the call that led to no step is a turn of its own (no action), each step sits beside
    the call whose reply it acted on, and the last call's tokens are all there; the per-episode gateway metrics
    are in the record."""
    path, replies = _gateway_step(tokenizer, tmp_path)
    (record,) = read_records(path.parent)
    assert [(t.turn, t.call, t.step) for t in record.turns] == [(1, 1, 0), (2, 2, 1), (3, 3, 2)]
    assert [[i for i, m in zip(t.token_ids, t.mask) if m] for t in record.turns] == replies
    assert record.turns[0].actions == [] and record.turns[0].reward == 0.0 and not record.turns[0].done
    assert record.turns[0].reply == "I am not sure." and record.turns[0].observation == "grid 0"
    assert record.turns[1].actions == ["Left"] and record.turns[2].actions == ["Down"] and record.turns[2].done
    assert record.metrics["gateway_rows"] == 1.0 and record.metrics["gateway_breaks"] == 0.0
    dom = headless("--dump-dom", (path.parent / "viewer.html").as_uri())
    shown = re.search(r'<section id="episode">(.*)</section>', dom, re.S).group(1)
    assert "Turn 1 (call 1, no env step)" in shown and "Turn 2 (call 2, env step 1)" in shown
    assert "gateway_rows 1" in shown and "gateway_breaks 0" in shown


def test_the_judge_call_and_score_are_written_read_back_and_shown(tokenizer, play_mixed, mixed_manager, tmp_path):
    """With judge.enable a record carries the judge's verdict (typed when read back), and the viewer shows the score
    in the heading and the request and reply under the turns; an unscored episode shows why."""
    from agent_trainer.trajectory_rewards.judge import JudgeVerdict

    ctx_mgr = ContextManager(tokenizer, max_model_len=4096)
    played = play_mixed(ctx_mgr)
    batch = ctx_mgr.build_update_batch([played.episodes[k] for k in sorted(played.episodes)])
    messages = [{"role": "system", "content": "Judge it."}, {"role": "user", "content": "<trajectory>...</trajectory>"}]
    judge = {2: JudgeVerdict(mode="pointwise", score=0.25, call_id="call-7", seconds=0.5, messages=messages,
                             reply='{"score": 0.25}'),
             3: JudgeVerdict(mode="pointwise", score=None, error="timeout: no reply within judge.timeout_s = 2 s",
                             messages=messages)}
    path = write_step(tmp_path, 1, "train", mixed_manager.get_rollout_states(), batch, tokenizer, per_tag=2,
                      judge=judge)
    records = {r.env_id: r for r in read_records(path.parent)}
    assert records[2].judge == judge[2] and records[3].judge == judge[3] and records[0].judge is None
    dom = headless("--dump-dom", (path.parent / "viewer.html").as_uri() + "#tag=Bandit&index=0")
    shown = re.search(r'<section id="episode">(.*)</section>', dom, re.S).group(1)
    assert "Bandit · env 2" in shown and "judge: score 0.25" in shown
    assert "Judge (pointwise) · score 0.25 · trajectory 1 · call call-7" in shown
    assert "system:\nJudge it." in shown and 'reply:\n{"score": 0.25}' in shown.replace("&quot;", '"')
    dom = headless("--dump-dom", (path.parent / "viewer.html").as_uri() + "#tag=Bandit&index=1")
    assert "unscored: timeout: no reply" in re.search(r'<section id="episode">(.*)</section>', dom, re.S).group(1)
