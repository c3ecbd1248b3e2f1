"""The builder's --size presets: the ~19M-parameter model of the scaling benchmarks (bench P2/P7)."""

from __future__ import annotations

import inspect
import json

from launch import build_tiny_model as btm


def test_size_preset_shapes_the_model_and_explicit_flags_win(tmp_path):
    out = btm.main(["--size", "20m", "--layers", "1", "--out", str(tmp_path / "m"), "--warmup-steps", "0",
                    "--corpus-seeds", "2", "--format-samples", "1"])
    info = json.loads((out / "build_info.json").read_text())
    preset = btm.SIZE_PRESETS["20m"]
    assert (info["hidden_size"], info["intermediate_size"], info["kv_heads"]) == (
        preset["hidden_size"], preset["intermediate_size"], preset["kv_heads"])
    assert info["layers"] == 1  # --layers overrides the preset

    from transformers import AutoTokenizer

    full = btm.make_model(AutoTokenizer.from_pretrained(out), **{**preset, "max_position_embeddings": 2048})
    assert 15e6 < sum(p.numel() for p in full.parameters()) < 25e6  # "about 20M", the size the 19M build is named for


def test_tiny_preset_is_the_builders_default_shape():
    preset = btm.SIZE_PRESETS["tiny"]
    defaults = inspect.signature(btm.build_tiny_model).parameters
    assert {key: defaults[key].default for key in preset} == preset


def test_tokenizer_from_takes_another_builds_tokenizer_whose_corpus_differs(tmp_path):
    """A note-answers build of another seed trains another tokenizer; with --tokenizer-from it reads the first
    build's token ids exactly (what a distillation teacher of that build needs)."""
    from transformers import AutoTokenizer

    small = ["--warmup-steps", "0", "--corpus-seeds", "2", "--format-samples", "1"]
    first = btm.main(["--out", str(tmp_path / "first"), "--seed", "0", *small])
    own = btm.main(["--out", str(tmp_path / "own"), "--seed", "1", "--note-answers", *small])
    taken = btm.main(["--out", str(tmp_path / "taken"), "--seed", "1", "--note-answers", "--tokenizer-from", str(first),
                      *small])
    vocab = {name: AutoTokenizer.from_pretrained(path).get_vocab() for name, path in
             (("first", first), ("own", own), ("taken", taken))}
    assert vocab["own"] != vocab["first"] and vocab["taken"] == vocab["first"]
    info = json.loads((taken / "build_info.json").read_text())
    assert info["tokenizer_from"] == str(first) and info["vocab_size"] == len(vocab["first"])
    assert json.loads((own / "build_info.json").read_text())["tokenizer_from"] is None
