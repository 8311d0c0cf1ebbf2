"""Training through a bounded local cache of store parts (the plan's windows and online samples streamed by row
group are tests/drafter/test_data.py's).

Parts live in a real S3 endpoint (moto's ThreadedMotoServer on 127.0.0.1); the
cache limit is smaller than two parts, so training must evict and fetch again.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_assets.drafter.recipe import DrafterRecipe
from dflash_assets.drafter.training import train_drafter
from dflash_assets.hidden_states.part_cache import BoundedPartCache, PartTooLarge
from dflash_assets.store import layout
from tests.drafter.test_model import MINI_MASK, MINI_VOCAB, greedy_sequences, mini_target, one_thread, write_cache  # noqa: F401


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """A mini target and four one-part partitions of its hidden-state cache (4 sequences each)."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    base = tmp_path_factory.mktemp("parts")
    tdir = mini_target(base / "target")
    target = AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32).eval()
    seqs = greedy_sequences(target, n=16, prompt_len=8, new_tokens=40, seed=0, vocab_hi=MINI_VOCAB - 12)
    files = [write_cache(base / f"shard-{k:05d}.safetensors", target, seqs[4 * k:4 * k + 4], layer_ids=[1, 3])
             for k in range(4)]
    return {"target_dir": tdir, "files": files}


def recipe(**kw) -> DrafterRecipe:
    d = dict(name="bounded", num_layers=2, block_size=8, epochs=3, batch_size=2, max_anchors=8, lr=3e-3,
             mask_token_id=MINI_MASK, save_every=100, seed=5)
    d.update(kw)
    return DrafterRecipe(**d)


@pytest.mark.parametrize("batch_size", [2, 3])  # 3: windows of 4 samples end inside a step
def test_training_through_a_cache_smaller_than_two_parts_matches_local_files(parts, s3_store, tmp_path, batch_size):
    files = parts["files"]
    keys = []
    for f in files:
        key = f"{layout.HIDDEN_STATE_CACHE}/{f.stem}/v1/{f.name}"
        s3_store.upload_file(key, f)
        keys.append(key)
    sizes = {k: f.stat().st_size for k, f in zip(keys, files)}
    limit = int(1.5 * max(sizes.values()))  # one part fits, two never do
    r = recipe(cache_limit_gb=limit / 1e9, batch_size=batch_size)

    local = train_drafter(r, files, parts["target_dir"], tmp_path / "local")
    cache = BoundedPartCache(s3_store, keys, limit, sizes=sizes, cache_dir=tmp_path / "parts")
    bounded = train_drafter(r, keys, parts["target_dir"], tmp_path / "bounded", source=cache)

    np.testing.assert_allclose(bounded.losses, local.losses, rtol=1e-6, atol=1e-7)  # same data, same order
    assert bounded.finished and len(bounded.losses) == local.total_steps
    stats = bounded.data_stats
    assert stats["peak_gb"] * 1e9 <= limit  # never more than the limit on disk
    # windows of half the limit hold one part: each epoch reads each part once, in its own window (with batch 3
    # the epoch's last step wraps around to its first window: one more fetch per epoch); no part is fetched twice
    # in a row, however the windows fall across steps
    assert 4 * r.epochs <= stats["downloads"] <= (4 if batch_size == 2 else 5) * r.epochs
    assert stats["evictions"] == stats["downloads"] - 1
    assert not list((tmp_path / "parts").iterdir())  # the local parts went with the cache


def test_a_part_larger_than_the_limit_is_refused_before_training(parts, s3_store, tmp_path):
    f = parts["files"][0]
    s3_store.upload_file("hidden_state_cache/big/v1/big.safetensors", f)
    with pytest.raises(PartTooLarge, match=r"hidden_state_cache/big/v1/big.safetensors, is 0\.0\d+ GB.*cache_limit_gb"):
        BoundedPartCache(s3_store, ["hidden_state_cache/big/v1/big.safetensors"], f.stat().st_size - 1,
                         cache_dir=tmp_path)


class CountingStore:
    def __init__(self, store):
        self.store, self.calls = store, {"list": 0, "size": 0, "read_json": 0}

    def __getattr__(self, name):
        attr = getattr(self.store, name)
        if name in self.calls:
            def counted(*a, **kw):
                self.calls[name] += 1
                return attr(*a, **kw)
            return counted
        return attr


def test_cache_listing_is_one_listing_and_one_read_per_partition(local_store, tmp_path):
    from dflash_assets.store.manifest import publish_files

    for k in range(5):
        files = {}
        for j in range(3):
            p = tmp_path / f"s{k}-{j}.safetensors"
            p.write_bytes(b"x" * (10 + j))
            files[p.name] = p
        publish_files(local_store, layout.hidden_state_manifest(f"shard-{k}"), layout.hidden_state_versions(f"shard-{k}"),
                      files)
    counting = CountingStore(local_store)
    entries = layout.list_hidden_state_entries(counting)
    assert counting.calls == {"list": 1, "size": 0, "read_json": 5}
    assert [e["bytes"] for e in entries["shard-3"]] == [10, 11, 12]
    assert sum(len(v) for v in entries.values()) == 15
