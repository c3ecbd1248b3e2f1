"""Sharded checkpoints (agent_trainer/workers/sharded_checkpoint.py): every rank writes its own shards, no rank gathers
the model, nothing is pickled, and a checkpoint loads at its own world size, at another one (2 -> 1, 1 -> 2) and
as a Hugging Face folder through ``python -m agent_trainer.export``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from agent_trainer.common.batch import TensorBatch
from agent_trainer.config import ActorConfig, FSDPConfig, ModelConfig, OptimConfig
from agent_trainer.workers import sharded_checkpoint
from agent_trainer.workers.actor import ActorWorker

REPO = Path(__file__).resolve().parents[2]


def test_chunk_rows_are_torch_chunk():
    """FSDP2 shards dim 0 like torch.chunk: uneven, and empty on the last ranks when rows < ranks."""
    for rows in (0, 1, 2, 3, 5, 7, 8, 1789):
        for world in (1, 2, 3, 4, 8):
            chunks = torch.arange(rows).chunk(world) if rows else ()
            expected = [(int(c[0]), int(c[-1]) + 1) for c in chunks if len(c)]
            got = [sharded_checkpoint.chunk_rows(rows, world, r) for r in range(world)]
            assert [g for g in got if g[1] > g[0]] == expected, (rows, world)
            assert sum(hi - lo for lo, hi in got) == rows


def test_streamed_safetensors_read_back_with_safetensors(tmp_path):
    """write_safetensors streams one tensor at a time and writes the standard format (0-dim, bf16, empty too)."""
    tensors = {"a": torch.randn(5, 3), "step": torch.tensor(7.0), "b": torch.randn(4).to(torch.bfloat16),
               "i": torch.arange(6, dtype=torch.int64).view(2, 3), "empty": torch.zeros(0, 3)}
    specs = [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    size = sharded_checkpoint.write_safetensors(tmp_path / "x.safetensors", specs, tensors.__getitem__, {"format": "pt"})
    assert size == (tmp_path / "x.safetensors").stat().st_size
    back = load_file(str(tmp_path / "x.safetensors"))
    assert set(back) == set(tensors) and all(torch.equal(back[k], v) for k, v in tensors.items())
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_slice("a")[1:4], tensors["a"][1:4])
        assert f.metadata() == {"format": "pt"}
    with pytest.raises(ValueError, match="declared"):
        sharded_checkpoint.write_safetensors(tmp_path / "y.safetensors", [("a", (2,), torch.float32)],
                                             lambda _: torch.zeros(3))


# --------------------------------------------------------------------------- the actor at 1 and 2 ranks


def _batch(seed: int) -> TensorBatch:
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(4, 16, dtype=torch.long)
    mask[:, 8:] = 1
    return TensorBatch({"input_ids": torch.randint(3, 200, (4, 16), generator=gen),
                        "attention_mask": torch.ones(4, 16, dtype=torch.long),
                        "position_ids": torch.arange(16).expand(4, 16).clone(), "response_mask": mask,
                        "advantages": torch.randn(4, 16, generator=gen) * mask})


def _worker(path: str, rank: int, world: int) -> ActorWorker:
    cfg = ActorConfig(ppo_mini_batch_size=4 * world, ppo_micro_batch_size_per_gpu=2, grad_clip=1e9,
                      optim=OptimConfig(lr=1e-3, warmup_steps=3), fsdp=FSDPConfig(world_size=world))
    worker = ActorWorker(rank=rank, world_size=world, model=ModelConfig(path=path), actor=cfg, device="cpu")
    worker.init_model()
    return worker


def _save(worker: ActorWorker, path: Path, hf_model: bool = True) -> None:
    """The policy's save (``FSDPWorker.save_checkpoint``, what ``ActorWorker`` runs for role actor)."""
    from agent_trainer.workers.fsdp_base import FSDPWorker

    FSDPWorker.save_checkpoint(worker, str(path), hf_model=hf_model)


def _train(worker: ActorWorker, seed: int) -> None:
    batch = _batch(seed * 10 + worker.rank)
    worker.update_actor(batch.update(worker.compute_log_prob(batch)))


def _full_state(worker: ActorWorker) -> dict[str, torch.Tensor]:
    """Weights and Adam state, unsharded (a test-side gather: ``full_tensor``), keyed like the checkpoint."""
    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()

    out = {f"model/{n}": full(p) for n, p in worker.model.named_parameters()}
    for name, param in worker.model.named_parameters():
        for key, value in worker.optimizer.state[param].items():
            out[f"optim/{key}/{name}"] = full(value)
    return out


def _assert_state(worker: ActorWorker, expected: dict[str, torch.Tensor]) -> None:
    got = _full_state(worker)
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key


def _no_gathers(monkeypatch) -> None:
    """Make every way of unsharding a tensor fail: a sharded save calls none of them."""
    import torch.distributed.checkpoint.state_dict as dcp_state_dict
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    import agent_trainer.workers.fsdp_base as fsdp_base

    def refuse(*args, **kwargs):
        raise AssertionError("a sharded save gathered a tensor")

    monkeypatch.setattr(fsdp_base, "gather_full_weights", refuse)
    monkeypatch.setattr(fsdp_base, "get_model_state_dict", refuse)
    for name in ("get_model_state_dict", "get_optimizer_state_dict", "get_state_dict"):
        monkeypatch.setattr(dcp_state_dict, name, refuse)
    monkeypatch.setattr(ActorWorker, "full_state_dict", refuse)
    monkeypatch.setattr(DTensor, "full_tensor", refuse)
    monkeypatch.setattr(DTensor, "redistribute", refuse)
    monkeypatch.setattr(FSDPModule, "unshard", refuse)


def _two_ranks(rank: int, init_file: str, model_path: str, tmp: str, results) -> None:
    """1 -> 2: load the 1-rank checkpoint; 2 -> 2: train, save (no gathers), load into fresh ranks, continue."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        tmp = Path(tmp)
        import _pytest.monkeypatch

        worker = _worker(model_path, rank, 2)
        worker.load_checkpoint(str(tmp / "one_rank" / "actor"))
        one = load_file(str(tmp / "one_rank_state.safetensors"))
        _assert_state(worker, one)  # each rank took its rows of the 1-rank tensors
        assert worker.lr_scheduler.last_epoch == 1
        _train(worker, seed=2)
        mp = _pytest.monkeypatch.MonkeyPatch()
        _no_gathers(mp)
        try:
            _save(worker, tmp / "two_ranks" / "actor", hf_model=False)
        finally:
            mp.undo()
        saved = _full_state(worker)
        if rank == 0:
            save_file({k: v.contiguous() for k, v in saved.items()}, str(tmp / "two_ranks_state.safetensors"))
        resumed = _worker(model_path, rank, 2)
        resumed.load_checkpoint(str(tmp / "two_ranks" / "actor"))
        _assert_state(resumed, saved)
        for w in (worker, resumed):
            _train(w, seed=3)
        after, after_resumed = _full_state(worker), _full_state(resumed)
        results[rank] = all(torch.equal(after[k], after_resumed[k]) for k in after) and set(after) == set(saved)
    finally:
        dist.destroy_process_group()


def _file_bytes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*") if p.is_file()}


def _assert_nothing_pickled(folder: Path) -> None:
    """Every file is JSON or safetensors (opened by safetensors, never by pickle); no DCP .metadata."""
    for path in folder.rglob("*"):
        if not path.is_file():
            continue
        if path.suffix != ".safetensors":  # a safetensors file starts with its header's length, which may be 0x80..
            assert not path.read_bytes()[:2].startswith(b"\x80"), f"{path} looks like a pickle"
        if path.suffix == ".json":
            json.loads(path.read_text())
        elif path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt") as f:
                list(f.keys())
        else:
            assert path.suffix in (".jinja", ".txt"), path


def test_sharded_round_trips_across_world_sizes(tiny_model_path, tmp_path, monkeypatch):
    """1 rank saves (with the HF folder); 2 gloo ranks load it (1 -> 2), train, save without gathering anything
    (2 -> 2 continues bit-exactly), and 1 rank loads that (2 -> 1); the index is JSON, nothing is pickled,
    and rank 0 wrote about half of the model's bytes."""
    import torch.multiprocessing as mp

    one = _worker(tiny_model_path, 0, 1)
    _train(one, seed=1)
    one.save_checkpoint(str(tmp_path / "one_rank" / "actor"))
    save_file({k: v.contiguous() for k, v in _full_state(one).items()}, str(tmp_path / "one_rank_state.safetensors"))
    folder = tmp_path / "one_rank" / "actor"
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    assert (folder / "shards" / "index.json").is_file() and (folder / "rng" / "rank_0.json").is_file()

    ctx = mp.get_context("spawn")
    results = ctx.Manager().dict()
    procs = [ctx.Process(target=_two_ranks, args=(r, str(tmp_path / "pg"), tiny_model_path, str(tmp_path), results))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert [p.exitcode for p in procs] == [0, 0]
    assert results[0] and results[1]  # 2 -> 2: the resumed ranks' next update equals the original's

    two = tmp_path / "two_ranks" / "actor"
    files = _file_bytes(two)
    assert not any(name.endswith("model.safetensors") for name in files)  # save_hf_model=false: no HF weights
    index = json.loads((two / "shards" / "index.json").read_text())
    assert index["world_size"] == 2 and index["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}
    embed = index["tensors"]["model/model.embed_tokens.weight"]
    vocab = one.model.get_input_embeddings().weight.shape[0]
    half = -(-vocab // 2)  # FSDP2's dim-0 shards: the first rank takes the larger half
    assert embed["sharding"] == "dim0" and [p["rows"] for p in embed["pieces"]] == [[0, half], [half, vocab]]
    model_bytes = sum(p.numel() * p.element_size() for p in one.model.parameters())
    for rank in range(2):
        share = files[f"shards/model-rank{rank:05d}-of-00002.safetensors"] / model_bytes
        assert 0.45 < share < 0.55, share  # each rank wrote its half of the weights, no more
        optim_share = files[f"shards/optim-rank{rank:05d}-of-00002.safetensors"] / model_bytes
        assert 0.9 < optim_share < 1.1, optim_share  # and its half of exp_avg + exp_avg_sq
    _assert_nothing_pickled(tmp_path / "one_rank")
    _assert_nothing_pickled(two)

    # 2 -> 1
    back = _worker(tiny_model_path, 0, 1)
    back.load_checkpoint(str(two))
    _assert_state(back, load_file(str(tmp_path / "two_ranks_state.safetensors")))
    assert back.lr_scheduler.last_epoch == 2


def test_export_gives_the_live_models_log_probs(tiny_model_path, tmp_path):
    """``python -m agent_trainer.export`` assembles an HF folder from the shards alone (no HF weights saved),
    with the config and tokenizer; it holds the live model's weights and gives its log-probs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    live = _worker(tiny_model_path, 0, 1)
    _train(live, seed=1)
    step = tmp_path / "global_step_1"
    _save(live, step / "actor", hf_model=False)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(str(step / "actor"))
    assert not list((step / "actor").glob("model*.safetensors"))
    out = tmp_path / "exported"
    run = subprocess.run([sys.executable, "-m", "agent_trainer.export", str(step), "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert (out / "tokenizer.json").is_file() and not (out / "shards").exists() and not (out / "optim").exists()
    model = AutoModelForCausalLM.from_pretrained(str(out))
    live_state = live.full_state_dict()  # plain tensors whether or not an earlier test left a process group
    for name, value in model.state_dict().items():
        assert torch.equal(value, live_state[name]), name
    batch = _batch(5)
    expected = live.compute_log_prob(batch)["old_log_probs"]
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    log_probs = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    mask = batch["response_mask"][:, 1:].bool()
    assert torch.allclose(log_probs[mask], expected[:, 1:][mask], atol=1e-5)
    # bf16 on request: config and weights agree
    run = subprocess.run([sys.executable, "-m", "agent_trainer.export", str(step / "actor"), "--out",
                          str(tmp_path / "bf16"), "--dtype", "bfloat16"], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert load_file(str(tmp_path / "bf16" / "model.safetensors"))["model.norm.weight"].dtype == torch.bfloat16


def test_a_checkpoint_for_another_model_is_refused(tiny_model_path, tmp_path):
    worker = _worker(tiny_model_path, 0, 1)
    _save(worker, tmp_path / "actor", hf_model=False)
    index_file = tmp_path / "actor" / "shards" / "index.json"
    index = json.loads(index_file.read_text())
    del index["tensors"]["model/model.norm.weight"]
    index_file.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"lacks weights \['model.norm.weight'\]"):
        _worker(tiny_model_path, 0, 1).load_checkpoint(str(tmp_path / "actor"))


def test_a_checkpoint_from_before_shards_still_loads(tiny_model_path, tmp_path):
    """The unsharded layout (an HF folder, optim/optimizer.safetensors + optimizer.json, no shards/) resumes."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from agent_trainer.common import checkpoint

    old = _worker(tiny_model_path, 0, 1)
    _train(old, seed=1)
    folder = tmp_path / "actor"
    old.model.save_pretrained(str(folder))  # what the unsharded save wrote, file for file
    tensors, meta = checkpoint.flatten_optimizer_state(get_optimizer_state_dict(old.model, old.optimizer))
    (folder / "optim").mkdir()
    save_file(tensors, str(folder / "optim" / "optimizer.safetensors"))
    checkpoint.write_json(folder / "optim" / "optimizer.json", meta)
    checkpoint.write_json(folder / "optim" / "lr_scheduler.json", old.lr_scheduler.state_dict())
    assert not (folder / "shards").exists()
    resumed = _worker(tiny_model_path, 0, 1)
    resumed.load_checkpoint(str(folder))
    _assert_state(resumed, _full_state(old))
    from agent_trainer.export import main as export_main

    assert export_main([str(folder), "--out", str(tmp_path / "x")]) == 2  # nothing to export: it is an HF folder
