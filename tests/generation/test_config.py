"""The target's identity in completions' ``config_hash``: two target directories of the same basename (one weight
byte apart) never share a hash, so a fine-tune written in place or a new revision under the same name regenerates
instead of resuming the old target's rows (through the stage: test_stage.py); the basename-only form stays for
remote engines (no local dir). Model ids compared across their spellings (`normalize_model_id`), and the hash
tracking every sampling setting."""

from __future__ import annotations

import pytest

from dflash_assets.generation.config import GenerationConfig, normalize_model_id
from dflash_assets.target_model.spec import TargetModelSpec


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


def test_candidate_settings_are_the_defaults_and_each_run_in_both_thinking_modes():
    from dflash_assets.generation.config import candidate_settings

    greedy = GenerationConfig(temperature=0.0, max_new_tokens=64)
    got = candidate_settings([greedy, greedy.model_copy()], thinking=True)
    assert [(s["temperature"], s["max_new_tokens"], s["enable_thinking"]) for s in got] == [
        (0.6, GenerationConfig().max_new_tokens, True), (0.6, GenerationConfig().max_new_tokens, False),
        (0.0, 64, True), (0.0, 64, False)]  # the same run config twice is listed once
    assert {GenerationConfig(**s).config_hash("m") for s in got} == {
        c.config_hash("m") for c in (GenerationConfig(enable_thinking=True), GenerationConfig(enable_thinking=False),
                                     greedy.model_copy(update={"enable_thinking": True}),
                                     greedy.model_copy(update={"enable_thinking": False}))}
