"""The target's identity in completions' ``config_hash``: two target directories of the same basename (one weight
byte apart) never share a hash, so a fine-tune written in place or a new revision under the same name regenerates
instead of resuming the old target's rows; the basename-only form stays for remote engines (no local dir). Model ids
compared across their spellings (`normalize_model_id`), and the hash tracking every sampling setting."""

from __future__ import annotations

import shutil

import pyarrow as pa
import pytest

from dflash_assets.generation.config import GenerationConfig, normalize_model_id
from dflash_assets.generation.fleet import EndpointConfig, EngineFleetConfig
from dflash_assets.generation.stage import regenerate_partition
from dflash_assets.store import layout
from dflash_assets.target_model.spec import TargetModelSpec
from tests.support.sglang_loopback import LoopbackServer


@pytest.fixture
def two_targets(tiny_dense_target, tmp_path):
    """``a/m`` and ``b/m``: copies of the tiny target; b has one weight byte changed (past the safetensors header)."""
    a, b = tmp_path / "a" / "m", tmp_path / "b" / "m"
    shutil.copytree(tiny_dense_target, a)
    shutil.copytree(tiny_dense_target, b)
    weights = b / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    return TargetModelSpec(model_path=str(a), dtype="float32"), TargetModelSpec(model_path=str(b), dtype="float32")


def test_same_basename_other_weights_other_config_hash(two_targets):
    a, b = two_targets
    gen = GenerationConfig(max_new_tokens=16)
    fa, fb = a.generation_fingerprint(), b.generation_fingerprint()
    assert fa and fb and fa != fb
    assert gen.config_hash(a.model_path, target_fingerprint=fa) != gen.config_hash(b.model_path, target_fingerprint=fb)
    # the same directory twice: the same hash (the sample is content, read once per path/size/mtime)
    again = TargetModelSpec(model_path=a.model_path, dtype="float32")
    assert again.generation_fingerprint() == fa
    assert gen.config_hash(a.model_path, target_fingerprint=fa) == gen.config_hash(
        again.model_path, target_fingerprint=again.generation_fingerprint())
    # without a fingerprint (a remote engine, no local dir known) the basename alone names the target, as before
    assert gen.config_hash(a.model_path) == gen.config_hash(b.model_path) == gen.config_hash("org/m")
    assert gen.config_hash(a.model_path, target_fingerprint=fa) != gen.config_hash(a.model_path)


def test_fingerprint_follows_config_tokenizer_and_template_not_layers(two_targets, tmp_path):
    a, _ = two_targets
    base = a.generation_fingerprint()
    assert a.model_copy(update={"num_target_layers": 3}).generation_fingerprint() == base  # capture, not answers
    assert a.model_copy(update={"chat_template_kwargs": {"enable_thinking": False}}).generation_fingerprint() != base
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert a.model_copy(update={"chat_template_path": str(template)}).generation_fingerprint() != base
    root = tmp_path / "a" / "m"
    for name in ("tokenizer_config.json", "config.json"):
        original = (root / name).read_text()
        (root / name).write_text(original.replace("{", '{"x_edit": 1, ', 1))
        assert a.generation_fingerprint() != base, name
        (root / name).write_text(original)
        assert a.generation_fingerprint() == base, name
    assert TargetModelSpec(model_path="Qwen/Qwen3.6-27B").generation_fingerprint() is None  # hub id: nothing to sample


def test_resume_does_not_reuse_rows_of_another_target_of_the_same_name(two_targets, local_store):
    a, b = two_targets
    rows = [{"prompt_id": f"p{i}", "system": None, "user_turns": [f"question {i}"]} for i in range(3)]
    local_store.write_parquet(layout.raw_prompts("s"), pa.Table.from_pylist(rows))
    gen = GenerationConfig(max_new_tokens=16)

    def fleet(srv, spec):
        return EngineFleetConfig(target_model=spec.model_path, backoff_initial_s=0.01,
                                 endpoints=[EndpointConfig(url=srv.url, max_concurrency=2)])

    with LoopbackServer(model_path=a.model_path) as srv:
        first = regenerate_partition(local_store, "s", a, fleet(srv, a), generation=gen)
        same = regenerate_partition(local_store, "s", a, fleet(srv, a), generation=gen)
        assert srv.stats.generate_requests == 3 and same.stats.prompts_resumed == 3  # same dir: rows reused
        other = regenerate_partition(local_store, "s", b, fleet(srv, b), generation=gen)
        assert srv.stats.generate_requests == 6  # b/m: everything regenerated, nothing resumed
    assert first.config_hash == same.config_hash == gen.config_hash(a.model_path, None, a.generation_fingerprint())
    assert other.stats.prompts_resumed == 0 and other.config_hash != first.config_hash
    assert set(other.table["config_hash"].to_pylist()) == {other.config_hash}


@pytest.mark.parametrize("a,b", [
    ("/models/Qwen3.6-27B/", "Qwen/Qwen3.6-27B"),
    ("qwen3.6-27b@main", "Qwen3.6-27B"),
    ("Qwen3-8B", "/data/ckpt/qwen3-8b"),
])
def test_normalize_model_id_matches(a, b):
    assert normalize_model_id(a) == normalize_model_id(b)


def test_normalize_model_id_distinguishes():
    assert normalize_model_id("Qwen/Qwen3-8B") != normalize_model_id("Qwen/Qwen3.6-27B")


def test_config_hash_tracks_every_setting_and_target():
    g = GenerationConfig()
    assert g.config_hash("t") == GenerationConfig().config_hash("t")
    assert g.config_hash("t") != g.config_hash("other")
    assert g.config_hash("t") != GenerationConfig(temperature=0.7).config_hash("t")
    assert g.config_hash("t") != GenerationConfig(enable_thinking=False).config_hash("t")
    assert g.config_hash("/m/Qwen3-8B") == g.config_hash("Qwen/Qwen3-8B")  # normalized target id
