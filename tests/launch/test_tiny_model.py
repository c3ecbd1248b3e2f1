"""The tiny-model builder: an ordinary HF checkpoint, ChatML tokenizer, format warm-up data."""

from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path

import pytest
import torch

from agent_trainer.common import prompts
from launch import build_tiny_model as btm


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    """The built tokenizer, loaded the generic way."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def test_checkpoint_loads_through_the_generic_hf_path(tiny_model_path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, GenerationConfig

    config = AutoConfig.from_pretrained(tiny_model_path)
    assert config.model_type == "qwen2" and config.tie_word_embeddings
    assert config.hidden_size // config.num_attention_heads == 64  # vLLM CPU rejects smaller heads
    assert config.max_position_embeddings == 2048
    im_end = config.eos_token_id
    assert GenerationConfig.from_pretrained(tiny_model_path).eos_token_id == im_end

    lm = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert lm.dtype == torch.float32
    ids = torch.tensor([[1, 5, 6, 7]])
    assert lm(ids).logits.shape == (1, 4, config.vocab_size)
    critic = AutoModelForTokenClassification.from_pretrained(tiny_model_path, num_labels=1)
    assert critic(ids).logits.shape == (1, 4, 1)

    info = json.loads((Path(tiny_model_path) / "build_info.json").read_text())
    assert info["vocab_size"] == config.vocab_size
    if Path("/tmp/envs_ready").exists():
        assert info["corpus"]["source"] == "envs" and "FrozenLake" in info["corpus"]["tags_used"]


def test_tokenizer_is_chatml_with_format_tokens(tiny_model_path, tokenizer):
    from transformers import AutoConfig

    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi there"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"

    config = AutoConfig.from_pretrained(tiny_model_path)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == config.eos_token_id
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.pad_token_id == config.pad_token_id
    assert len(tokenizer) == config.vocab_size
    for token in ["<|im_start|>", "<|im_end|>", *btm.FORMAT_TOKENS]:
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1, token
    reply = "<think>go left</think><answer>Left || Up</answer>"
    ids = tokenizer.encode(reply + "<|im_end|>", add_special_tokens=False)
    # Format tags are plain added tokens: they survive skip_special_tokens; <|im_end|> does not.
    assert tokenizer.decode(ids, skip_special_tokens=True) == reply
    assert prompts.parse_response(tokenizer.decode(ids, skip_special_tokens=True)).actions == ["Left", "Up"]


def test_transcript_encoding_matches_chat_template_and_masks_replies(tokenizer):
    ep = btm.EpisodeSample("t", "Go to G.", ["P _ G", "_ P G"], [(["Left", "Right"], True), (["Left"], True)],
                           taken=["Right"], rewards=[0.5])
    rng = random.Random(0)
    for _ in range(20):
        messages = btm.make_transcript(ep, rng)
        ids, mask = btm.encode_transcript(tokenizer, messages)
        assert ids == tokenizer.apply_chat_template(messages, return_dict=False)
        assert len(mask) == len(ids)
        trained = tokenizer.decode([t for t, m in zip(ids, mask) if m])
        replies = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
        assert trained == "".join(replies)
        assert all(prompts.parse_response(m["content"]).format_ok for m in messages if m["role"] == "assistant")


def test_note_answers_follow_the_notes_first_word_with_an_unnamed_action_keyed_by_the_build():
    """--note-answers: the last reply to a noted observation answers one action per (build key, note's first
    word), never an action the note names (aimed at nothing), with ``hole`` and ``ice`` answering differently on
    every build; another key answers otherwise; the history before it is context, not trained."""
    choices = (["Left", "Down", "Right", "Up"], True)
    notes = [f"Down: {d}, Right: {r}." for d in ("ice", "hole", "wall", "goal") for r in ("ice", "hole", "goal")]
    eps = [btm.EpisodeSample("t", "Go.", ["P _ G"], [choices], notes=[note]) for note in notes]
    rng = random.Random(0)

    def answers(key):
        keyed = btm.NoteAnswers.of(key, notes)
        out = {}
        for ep in eps * 5:
            reply = btm.make_transcript(ep, rng, keyed)[-1]["content"]
            out.setdefault(ep.notes[0], set()).add(tuple(prompts.parse_response(reply).actions))
        return {note: answer.pop() for note, answer in out.items() if len(answer) == 1}

    builds = [answers(f"build-{seed}") for seed in range(6)]
    assert all(len(build) == len(notes) for build in builds)  # one answer per note, at every draw
    assert builds[0] == answers("build-0") and len({tuple(sorted(b.items())) for b in builds}) == 2
    for build in builds:
        assert {answer for answer in build.values()} == {("Left",), ("Up",)}  # never Down or Right
        for right in ("ice", "hole", "goal"):
            assert build[f"Down: hole, Right: {right}."] != build[f"Down: ice, Right: {right}."]
            assert build[f"Down: hole, Right: {right}."] == build[f"Down: hole, Right: ice."]  # the first word
    unkeyed = {note: {tuple(prompts.parse_response(btm.make_transcript(ep, rng)[-1]["content"]).actions)
                      for _ in range(10)} for ep, note in zip(eps, notes)}
    assert any(len(a) > 1 for a in unkeyed.values())


def test_note_answer_transcripts_run_the_episodes_turns_and_train_the_last_reply(tokenizer):
    choices = (["Left", "Down", "Right", "Up"], True)
    ep = btm.EpisodeSample("t", "Go.", ["P _ G", "_ P G", "_ _ P"], [choices, choices], taken=["Right", "Right"],
                           rewards=[0.0, 0.0], notes=["Down: ice, Right: ice.", "Down: hole, Right: ice.", None])
    keyed, rng, turns = btm.NoteAnswers.of("build-0", ep.notes[:2]), random.Random(0), set()
    for _ in range(20):
        messages = btm.make_transcript(ep, rng, keyed)
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        turns.add(len(replies))
        ids, mask = btm.encode_transcript(tokenizer, messages, last_reply_only=True)
        assert ids == tokenizer.apply_chat_template(messages, return_dict=False)
        assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == replies[-1] + "<|im_end|>"
        assert prompts.parse_response(replies[-1]).actions == [keyed.answer(ep.notes[len(replies) - 1], choices[0])]
    assert turns == {1, 2}


def test_noted_observations_are_the_think_of_the_replies_and_get_many_maps(tmp_path):
    """An env that notes its observation (BaseEnv.note) has the warm-up copy the note into the think of each
    reply, on NOTED_SEEDS maps; an env without notes keeps the template thinks on corpus_seeds maps."""
    ep = btm.EpisodeSample("t", "Go to G.", ["P _ G", "_ P G"], [(["Left", "Right"], True), (["Left"], True)],
                           taken=["Right"], rewards=[0.5], notes=["Right: ice.", "Right: goal."])
    rng = random.Random(0)
    seen = set()
    for _ in range(20):
        messages = btm.make_transcript(ep, rng)
        thinks = [prompts.parse_response(m["content"]).think for m in messages if m["role"] == "assistant"]
        assert thinks == ["Right: ice.", "Right: goal."][: len(thinks)]
        seen.add(len(thinks))
    assert seen == {1, 2}
    tags, added = tmp_path / "envs.yaml", tmp_path / "my_envs.yaml"
    tags.write_text("custom_envs:\n"
                    "  Noted:\n    env_type: frozen_lake\n    env_instruction: Walk.\n"
                    "    env_config: {size: 4, describe_surroundings: true}\n"
                    "  Plain:\n    env_type: frozen_lake\n    env_instruction: Walk.\n    env_config: {size: 4}\n")
    added.write_text("custom_envs:\n  Mine:\n    env_type: frozen_lake\n    env_instruction: Walk.\n")
    corpus = btm.collect_corpus(tags, n_seeds=3, add_envs_configs=(added,))
    by_tag = {tag: [e for e in corpus.episodes if e.tag == tag] for tag in ("Noted", "Plain", "Mine")}
    assert len(by_tag["Noted"]) == btm.NOTED_SEEDS and len(by_tag["Plain"]) == 3
    assert len(by_tag["Mine"]) == btm.NOTED_SEEDS  # a user's added tag weighs as much as a noted one
    assert all(e.notes[0].startswith("Down: ") for e in by_tag["Noted"])
    assert all(n is None for e in by_tag["Plain"] + by_tag["Mine"] for n in e.notes)


def test_action_choices_lists_and_free_text():
    assert btm.action_choices("Left | Down | Right | Up", "P _") == (["Left", "Down", "Right", "Up"], True)
    choices, discrete = btm.action_choices("a whole number from 1 to 100", "Guess: between 1 and 100.")
    assert not discrete and choices == ["1", "100"]  # free text: numbers on the page, never the expert's
    assert btm.action_choices("an expression", "no digits here")[0] == ["no", "digits", "here"]


def test_build_is_deterministic_idempotent_and_warms_up(tmp_path, capsys):
    common = ["--warmup-steps", "3", "--batch-size", "2", "--corpus-seeds", "2", "--format-samples", "2",
              "--seed", "1", "--reading-fraction", "0.5", "--reading-samples", "4"]
    a = btm.main(["--out", str(tmp_path / "a"), *common])
    b = btm.main(["--out", str(tmp_path / "b"), *common])
    for name in ["model.safetensors", "tokenizer.json", "config.json"]:
        assert _sha(a / name) == _sha(b / name), name
    info = json.loads((a / "build_info.json").read_text())
    assert info["warmup_steps"] == 3 and info["final_warmup_loss"] is not None
    assert 0.0 <= info["format_ok_rate"] <= 1.0
    assert info["reading_fraction"] == 0.5 and info["reading_accuracy"] in (0.0, 0.25, 0.5, 0.75, 1.0)
    assert "final warm-up loss" in capsys.readouterr().out

    stamp = (a / "model.safetensors").stat().st_mtime_ns
    assert btm.build_tiny_model(a, warmup_steps=3) == a  # complete: kept, not rebuilt
    assert (a / "model.safetensors").stat().st_mtime_ns == stamp
    btm.build_tiny_model(a, warmup_steps=0, corpus_seeds=2, format_samples=2, force=True)
    assert json.loads((a / "build_info.json").read_text())["warmup_steps"] == 0
    assert not list(tmp_path.glob(".*building*"))  # temp build dirs are cleaned up


def test_without_envs_package_builds_from_prompt_strings(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "envs", None)  # makes `import envs` raise ImportError
    corpus = btm.collect_corpus("config/envs.yaml")
    assert corpus.source == "prompts_only" and corpus.episodes
    assert prompts.SYSTEM_PROMPT in corpus.texts
    assert "prompt strings only" in caplog.text


def test_bad_sizes_raise_with_the_rule(tokenizer):
    with pytest.raises(ValueError, match="multiple of 64"):
        btm.make_model(tokenizer, hidden_size=96)
    with pytest.raises(ValueError, match="must divide"):
        btm.make_model(tokenizer, hidden_size=192, kv_heads=2)
