"""A partition's hidden-state cache through a real local store: parts, manifest and reader round trip, two workers
writing the same bytes as one, and the storage budget refused before any compute."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer

from dflash_assets.hidden_states import batching, stage
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
from tests.hidden_states.support import BUDGET, LENGTHS, make_samples, samples_table


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
