"""Hidden-state capture: captured states equal HF ``output_hidden_states``, the cut model restored, packing, the
partition through the store, the budget, the GPU path's imports (the cache format: test_format.py).

Runs the tiny dense and hybrid targets on CPU in float32, so "equal" means
equal to float32 rounding, and a leak across packed samples shows up as a
difference of order one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_assets.hidden_states import batching, packing, stage
from dflash_assets.hidden_states import capture as hsc
from dflash_assets.hidden_states.format import (
    FORMAT_NAME,
    HiddenStateCacheReader,
    HiddenStateShard,
    StorageBudgetExceeded,
    bytes_per_token,
    estimate_partition_bytes,
)
from dflash_assets.store import layout
from dflash_assets.target_model.tokenizer import tokenizer_hash

ROOT = Path(__file__).resolve().parents[2]
LENGTHS = [7, 23, 1, 23, 40, 5, 23, 16]  # three of 23 tokens: the hybrid stacks those in one forward
BUDGET = 64  # tokens per forward: several samples share each one


def make_samples(lengths=LENGTHS, seed=0, vocab=248_000):
    rng = np.random.default_rng(seed)
    return [{"prompt_id": f"p{i:03d}", "input_ids": rng.integers(0, vocab, n).astype(np.int32),
             "loss_mask": (rng.random(n) > 0.4).astype(np.uint8)} for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def targets(tiny_dense_target, tiny_hybrid_target):
    """Per kind: (path, capture model, independent HF reference model), float32 on CPU."""
    out = {}
    for kind, path in (("dense", tiny_dense_target), ("hybrid", tiny_hybrid_target)):
        model = hsc.load_target(path, "cpu", "float32")
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # plain sdpa
        out[kind] = (path, model, ref)
    return out


def hf_reference(ref, input_ids, layer_ids):
    with torch.no_grad():
        hs = ref(input_ids=torch.as_tensor(input_ids).long()[None], output_hidden_states=True).hidden_states
    return torch.cat([hs[i + 1][0] for i in layer_ids], dim=-1)


# ---------------------------------------------------------------------------
# Correctness against Transformers
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_captured_states_equal_hf_output_hidden_states(kind, targets):
    path, model, ref = targets[kind]
    n_layers = model.config.num_hidden_layers
    layer_ids = [0, 2, n_layers - 3, n_layers - 1]  # the last one: HF returns it after the final norm
    samples = make_samples()
    packed = packing.resolve_packing(model, "cpu")
    batches = batching.plan_batches(LENGTHS, BUDGET, packed=packed)
    assert packed == (kind == "dense")
    assert any(len(b.indices) > 1 for b in batches), "the test must share forwards between samples"

    got = hsc.capture_hidden_states(model, samples, layer_ids, tokens_per_batch=BUDGET)

    for s, g in zip(samples, got):
        expected = hf_reference(ref, s["input_ids"], layer_ids)
        assert g.shape == (len(s["input_ids"]), len(layer_ids) * 64) and g.dtype == torch.float32
        torch.testing.assert_close(g, expected, rtol=1e-5, atol=2e-5)


def test_leak_across_packed_samples_would_be_caught(targets):
    """Negative control: the same packed row with plain causal attention (no sample boundaries) differs."""
    _, model, ref = targets["dense"]
    samples = batching.load_samples(make_samples([30, 30]))
    ids = np.concatenate([s.input_ids for s in samples])
    pos = torch.cat([torch.arange(30), torch.arange(30)])[None]
    with torch.no_grad(), packing.packed_attention(model), hsc.LayerCapture(model, [3]) as cap:
        cap.target = torch.empty(60, 64)
        cap.text_model(input_ids=torch.from_numpy(ids).long()[None], position_ids=pos, use_cache=False)
        leaked = cap.target[30:].clone()
    expected = hf_reference(ref, samples[1].input_ids, [3])
    assert (leaked - expected).abs().max() > 1e-2


def test_capture_cuts_the_model_and_restores_it(targets):
    _, model, _ = targets["dense"]
    text, layers = hsc.decoder_stack(model)
    original_layers, original_norm = text.layers, text.norm
    calls = {"layer1": 0, "layer2": 0, "norm": 0, "lm_head": 0}

    def counter(name):
        def hook(*_):
            calls[name] += 1
        return hook

    handles = [layers[1].register_forward_hook(counter("layer1")), layers[2].register_forward_hook(counter("layer2")),
               text.norm.register_forward_hook(counter("norm")), model.lm_head.register_forward_hook(counter("lm_head"))]
    try:
        model.config._attn_implementation = "sdpa"
        hsc.capture_hidden_states(model, make_samples([5, 6]), [1], tokens_per_batch=BUDGET)
        assert calls == {"layer1": 1, "layer2": 0, "norm": 0, "lm_head": 0}
        bad = [{"prompt_id": "x", "input_ids": np.array([10**9], np.int64), "loss_mask": [1]}]
        with pytest.raises(IndexError):  # token id past the embedding: the forward raises mid-capture
            hsc.capture_hidden_states(model, bad, [1])
    finally:
        for h in handles:
            h.remove()
    assert text.layers is original_layers and len(text.layers) == model.config.num_hidden_layers
    assert text.norm is original_norm
    assert all(not layer._forward_hooks for layer in layers) and not text.norm._forward_hooks
    assert model.config._attn_implementation == "sdpa"  # switched for the capture only
    model.config._attn_implementation = packing.ATTN_IMPLEMENTATION


def test_hybrid_without_kernels_warns_and_refuses_packing(targets, caplog):
    _, model, _ = targets["hybrid"]
    assert packing.is_hybrid(model) and not packing.is_hybrid(targets["dense"][1])
    assert packing.linear_attention_kernels() == {"fla": False, "causal_conv1d": False}  # this machine
    with caplog.at_level(logging.WARNING, logger="dflash_assets.hidden_states.packing"):
        assert packing.resolve_packing(model, "cpu") is False
    assert "fla, causal_conv1d not importable" in caplog.text and "flash-linear-attention" in caplog.text
    with pytest.raises(ValueError, match="causal-conv1d"):
        packing.resolve_packing(model, "cpu", "packed")


# ---------------------------------------------------------------------------
# A partition: files, store, parts, workers, budget
# ---------------------------------------------------------------------------


def samples_table(samples):
    return pa.table({
        "prompt_id": [s["prompt_id"] for s in samples],
        "input_ids": pa.array([s["input_ids"].tolist() for s in samples], pa.list_(pa.int32())),
        "loss_mask": pa.array([s["loss_mask"].astype(np.int8).tolist() for s in samples], pa.list_(pa.int8())),
        "num_tokens": [len(s["input_ids"]) for s in samples],
    })


def test_partition_roundtrip_through_store(targets, local_store):
    path, model, _ = targets["dense"]
    samples = make_samples()
    layer_ids = (1, 3)
    row_bytes = bytes_per_token(2, 64, "float32")
    spec = hsc.CaptureSpec(target=str(path), target_id="tiny/dense", layer_ids=layer_ids, dtype="float32",
                           tokens_per_batch=BUDGET, max_part_bytes=60 * row_bytes, upstream_data_version="dv-42")
    result = stage.write_hidden_state_cache(local_store, "shard-00007", samples_table(samples), spec, models=[model])

    # 138 tokens in parts of at most 60 tokens' bytes, whole samples each: [7,23,1,23] [40,5] [23,16]
    manifest = local_store.read_json("hidden_state_cache/shard-00007.manifest.json")
    version = manifest["version"]
    assert result.keys == tuple(f"hidden_state_cache/shard-00007/{version}/shard-00007-0000{k}-of-00003.safetensors"
                                for k in (1, 2, 3))
    assert local_store.list("hidden_state_cache") == sorted([*result.keys, "hidden_state_cache/shard-00007.manifest.json"])
    assert [e["bytes"] for e in manifest["files"]] == [local_store.size(k) for k in result.keys]
    assert layout.list_hidden_state_parts(local_store) == {"shard-00007": list(result.keys)}
    meta = result.to_metadata()
    assert meta["num_samples"] == 8 and meta["num_tokens"] == sum(LENGTHS) and meta["num_parts"] == 3
    assert meta["packing"] == "packed" and meta["layer_ids"] == [1, 3]

    expected = hsc.capture_hidden_states(model, samples, layer_ids, tokens_per_batch=BUDGET)
    reader = HiddenStateCacheReader.from_store(local_store, result.keys)
    assert len(reader) == 8 and reader.prompt_ids == [s["prompt_id"] for s in samples]
    for i, s in enumerate(samples):
        got = reader[i]
        assert got.prompt_id == s["prompt_id"]
        assert torch.equal(got.hidden, expected[i])
        assert got.input_ids.dtype == torch.int32 and got.input_ids.tolist() == s["input_ids"].tolist()
        assert got.loss_mask.dtype == torch.uint8 and got.loss_mask.tolist() == s["loss_mask"].tolist()
        assert torch.equal(got.layer(1, 64), expected[i][:, 64:])
    m = reader.meta
    assert (m.target_model, m.layer_ids, m.dtype, m.hidden_size) == ("tiny/dense", (1, 3), "float32", 64)
    assert m.upstream_data_version == "dv-42"
    assert m.tokenizer_hash == tokenizer_hash(AutoTokenizer.from_pretrained(path)) != ""
    reader.close()

    # Plain safetensors sees a normal file: four tensors, our header, no pickle.
    first = local_store.local_path(result.keys[0])
    with safe_open(str(first), "pt") as f:
        assert sorted(f.keys()) == ["cu_seqlens", "hidden", "input_ids", "loss_mask"]
        header = f.metadata()
        assert f.get_tensor("cu_seqlens").tolist() == [0, 7, 30, 31, 54]
        assert f.get_slice("hidden").get_shape() == [54, 128]
    assert header["format"] == FORMAT_NAME and json.loads(header["layer_ids"]) == [1, 3]
    assert json.loads(header["prompt_ids"]) == ["p000", "p001", "p002", "p003"]
    assert (header["part_index"], header["num_parts"], header["sample_start"]) == ("0", "3", "0")
    with HiddenStateShard(local_store.local_path(result.keys[1])) as shard:
        assert shard.meta.sample_start == 4 and len(shard) == 2 and shard.span(1) == (40, 45)

    # Re-materialized as one part: the three old parts go (and a part written before manifests), other stems stay.
    local_store.write_bytes("hidden_state_cache/shard-00070.safetensors", b"other partition")
    local_store.write_bytes("hidden_state_cache/shard-00007-00001-of-00002.safetensors", b"pre-manifest part")
    again = stage.write_hidden_state_cache(local_store, "shard-00007", samples, dataclasses.replace(
        spec, max_part_bytes=1 << 30, tokenizer_hash="t"), models=[model])
    new_version = local_store.read_json("hidden_state_cache/shard-00007.manifest.json")["version"]
    assert new_version > version
    assert again.keys == (f"hidden_state_cache/shard-00007/{new_version}/shard-00007.safetensors",)
    assert local_store.list("hidden_state_cache") == sorted([*again.keys, "hidden_state_cache/shard-00007.manifest.json",
                                                             "hidden_state_cache/shard-00070.safetensors"])
    assert layout.list_hidden_state_parts(local_store) == {"shard-00007": list(again.keys),
                                                          "shard-00070": ["hidden_state_cache/shard-00070.safetensors"]}
    assert torch.equal(HiddenStateCacheReader.from_store(local_store, again.keys)[4].hidden, expected[4])


def test_two_workers_write_the_same_bytes_as_one(targets, tmp_path):
    path, model, _ = targets["dense"]
    spec = hsc.CaptureSpec(target=str(path), layer_ids=(2,), dtype="float32", tokens_per_batch=30,
                           tokenizer_hash="t")
    one = hsc.capture_partition(make_samples(), spec, tmp_path / "one", stem="s")
    two = hsc.capture_partition(make_samples(), spec, tmp_path / "two", stem="s", devices=["cpu", "cpu"])
    assert len(two.workers) == 2 and sum(w.batches for w in two.workers) == sum(w.batches for w in one.workers)
    assert one.paths[0].read_bytes() == two.paths[0].read_bytes()


def test_budget_refuses_before_any_compute(targets, tmp_path):
    path, model, _ = targets["dense"]
    forwards = []
    handle = model.model.embed_tokens.register_forward_hook(lambda *_: forwards.append(1))
    need = estimate_partition_bytes(sum(LENGTHS), len(LENGTHS), 2, 64, "float32")
    spec = hsc.CaptureSpec(target=str(path), layer_ids=(1, 3), dtype="float32", budget_bytes=10 * need,
                           tokenizer_hash="t")
    try:
        with pytest.raises(StorageBudgetExceeded, match="exceed the budget"):
            hsc.capture_partition(make_samples(), spec, tmp_path / "out", models=[model], used_bytes=9.5 * need)
        hsc.capture_partition(make_samples(), spec, tmp_path / "ok", models=[model], used_bytes=8 * need)
    finally:
        handle.remove()
    assert not list((tmp_path / "out").iterdir())
    assert len(forwards) > 0 and forwards.count(1) == len(batching.plan_batches(LENGTHS, spec.tokens_per_batch))
    written = sum(p.stat().st_size for p in (tmp_path / "ok").iterdir())
    assert 0.9 * need < written <= need  # the estimate is an upper bound, and a close one


# ---------------------------------------------------------------------------
# Samples and planning
# ---------------------------------------------------------------------------


def test_load_samples_from_sliced_arrow_table_and_lists():
    samples = make_samples()
    table = samples_table(samples).slice(2, 4)  # offsets into shared buffers
    got = batching.load_samples(table)
    assert [s.prompt_id for s in got] == ["p002", "p003", "p004", "p005"]
    for g, s in zip(got, samples[2:6]):
        assert g.input_ids.dtype == np.int32 and g.input_ids.tolist() == s["input_ids"].tolist()
        assert g.loss_mask.dtype == np.uint8 and g.loss_mask.tolist() == s["loss_mask"].tolist()
    assert [s.num_tokens for s in batching.load_samples(samples)] == LENGTHS
    with pytest.raises(ValueError, match="num_tokens"):
        batching.load_samples([{"prompt_id": "a", "input_ids": [1, 2], "loss_mask": [0, 1], "num_tokens": 3}])
    with pytest.raises(ValueError, match="no tokens"):
        batching.load_samples([{"prompt_id": "a", "input_ids": [], "loss_mask": []}])
    with pytest.raises(ValueError, match="loss_mask"):
        batching.load_samples([{"prompt_id": "a", "input_ids": [1, 2], "loss_mask": [1]}])


@pytest.mark.parametrize("lengths,budget", [(LENGTHS, 64), (LENGTHS, 30), ([100, 3, 3, 100, 7], 50), ([5] * 9, 10)])
@pytest.mark.parametrize("packed", [True, False])
def test_plan_batches(lengths, budget, packed):
    batches = batching.plan_batches(lengths, budget, packed=packed)
    flat = [i for b in batches for i in b.indices]
    assert sorted(flat) == list(range(len(lengths)))
    for b in batches:
        assert b.lengths == tuple(lengths[i] for i in b.indices) and b.packed == packed
        assert b.num_tokens <= budget or len(b.indices) == 1
        if packed:
            assert list(b.indices) == list(range(b.indices[0], b.indices[-1] + 1))  # contiguous in the shard
        else:
            assert len(set(b.lengths)) == 1
    if packed:
        assert flat == list(range(len(lengths)))
        # greedy: no two neighbouring batches could have been merged
        assert all(a.num_tokens + b.lengths[0] > budget for a, b in zip(batches, batches[1:]))


def test_plan_parts_splits_by_bytes():
    assert batching.plan_parts([10, 10, 10, 10], 1, 25) == [(0, 2), (2, 4)]
    assert batching.plan_parts([50, 1], 1, 25) == [(0, 1), (1, 2)]  # an oversized sample gets its own part
    assert batching.plan_parts([1, 2, 3], 8, 1 << 30) == [(0, 3)]


# ---------------------------------------------------------------------------
# Import hygiene and the benchmark
# ---------------------------------------------------------------------------


def test_gpu_path_imports_with_only_torch_transformers_safetensors_numpy():
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in {'pyarrow', 'polars', 'dagster', 'pydantic', 'boto3', 'tiktoken'}:\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import dflash_assets.hidden_states.capture as h, dflash_assets.hidden_states.format as f\n"
        "import dflash_assets.hidden_states.stage, dflash_assets.drafter.training\n"
        "print(h.ATTN_IMPLEMENTATION, f.FORMAT_NAME)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["packed_causal", FORMAT_NAME]


@pytest.mark.slow
def test_benchmark_quick_runs_every_section(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "bench/hidden_state_capture.py", "--quick", "--iters", "1",
                           "--json-out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    for name in ("peak", "a_naive", "b_hooks_cut", "c_end_to_end", "e_two_gpus", "d_hybrid"):
        assert "error" not in res[name], res[name]
    b = res["b_hooks_cut"]
    assert b["packed_varlen_vs_naive"]["max_abs"] < 1e-4 and b["stacked_sdpa_vs_naive"]["max_abs"] < 1e-4
    assert res["c_end_to_end"]["tokens"] > 0 and res["d_hybrid"]["stacked"]["tok_per_s"] > 0
