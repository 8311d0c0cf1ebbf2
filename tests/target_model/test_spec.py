"""TargetModelSpec: layer rule, resolution against tiny targets, and every validation error."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from dflash_assets.target_model.chat_template import default_chat_template, template_hash
from dflash_assets.embedded.defaults import default_target_spec
from dflash_assets.target_model.spec import (
    TargetFacts,
    TargetModelError,
    TargetModelSpec,
    dflash_target_layer_ids,
    text_config_of,
)
from dflash_assets.target_model.tokenizer import build_qwen3_6_tokenizer, tokenizer_hash


@pytest.mark.parametrize(
    "layers,n,expected",
    [
        (36, 5, [1, 9, 17, 25, 33]),  # Qwen3-8B
        (64, 5, [1, 16, 31, 46, 61]),  # Qwen3.6-27B
        (32, 5, [1, 8, 15, 22, 29]),
        (30, 5, [1, 8, 14, 20, 27]),  # SmolLM2-135M (7.5 and 20.5 round half to even)
        (36, 8, [1, 6, 10, 15, 19, 24, 28, 33]),
        (8, 5, [1, 2, 3, 4, 5]),  # the tiny targets
        (36, 1, [18]),
        (5, 2, [1, 2]),
    ],
)
def test_layer_rule(layers, n, expected):
    assert dflash_target_layer_ids(layers, n) == expected


@pytest.mark.parametrize("layers,n", [(6, 5), (3, 2), (36, 0), (0, 5)])
def test_layer_rule_rejects_impossible(layers, n):
    with pytest.raises(TargetModelError):
        dflash_target_layer_ids(layers, n)


def test_default_spec_validates(tiny_dense_target):
    spec = default_target_spec()
    assert spec.model_path == str(tiny_dense_target) and spec.resolved_tokenizer_path == spec.model_path
    assert spec.chat_template_kwargs == {"enable_thinking": True}
    facts = spec.validate()
    assert isinstance(facts, TargetFacts)
    assert (facts.model_type, facts.num_layers, facts.hidden_size) == ("qwen3", 8, 64)
    assert (facts.model_vocab_size, facts.tokenizer_vocab_size) == (248_320, 248_078)
    assert facts.layer_ids == (1, 2, 3, 4, 5) and spec.layer_ids() == [1, 2, 3, 4, 5]
    assert (facts.mask_token, facts.mask_token_id) == ("<|MASK|>", 248_077)
    assert spec.mask_token_id_resolved() == 248_077 and facts.eos_token_id == 248_046
    assert facts.tokenizer_hash == tokenizer_hash(build_qwen3_6_tokenizer())
    assert facts.template_hash == template_hash(default_chat_template())
    with pytest.raises(Exception):
        facts.num_layers = 3  # frozen


def test_tokenizer_cache(tmp_path, tiny_dense_target):
    spec = TargetModelSpec(model_path=str(tiny_dense_target))
    assert spec.load_tokenizer() is spec.load_tokenizer()
    fresh = spec.load_tokenizer(fresh=True)
    assert fresh is not spec.load_tokenizer() and len(fresh) == len(spec.load_tokenizer())
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0].content }}")
    other = spec.model_copy(update={"chat_template_path": str(template)}).load_tokenizer()
    assert other.chat_template == "{{ messages[0].content }}"
    assert spec.load_tokenizer().chat_template == default_chat_template()


def test_render_uses_template_kwargs(tiny_dense_target):
    spec = TargetModelSpec(model_path=str(tiny_dense_target), chat_template_kwargs={"enable_thinking": False})
    tok = spec.load_tokenizer()
    text = spec.render_chat(tok, [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_load_model_dtypes(tiny_dense_target):
    spec = TargetModelSpec(model_path=str(tiny_dense_target), dtype="float32")
    model = spec.load_model("cpu")
    assert next(model.parameters()).dtype == torch.float32 and not model.training
    assert spec.load_model(dtype="auto").dtype == torch.bfloat16  # as stored
    with torch.no_grad():
        out = model(torch.tensor([[1, 2, 3]]), output_hidden_states=True)
    assert len(out.hidden_states) == 9


def test_hybrid_and_nested_text_config(tmp_path, tiny_hybrid_target):
    from transformers import AutoConfig, Qwen3_5Config

    facts = TargetModelSpec(model_path=str(tiny_hybrid_target)).validate()
    assert (facts.model_type, facts.num_layers, facts.layer_ids) == ("qwen3_5_text", 8, (1, 2, 3, 4, 5))

    text = AutoConfig.from_pretrained(tiny_hybrid_target).to_dict()
    # differ from both the tiny target and the outer config's defaults on purpose
    text.update(num_hidden_layers=36, hidden_size=128, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 9)
    nested = Qwen3_5Config(text_config=text)
    nested.save_pretrained(tmp_path)
    spec = TargetModelSpec(model_path=str(tmp_path), tokenizer_path=str(tiny_hybrid_target))
    assert text_config_of(spec.load_config()).num_hidden_layers == 36
    facts = spec.validate()
    assert (facts.num_layers, facts.hidden_size, facts.layer_ids) == (36, 128, (1, 9, 17, 25, 33))


def _model_dir_with(tmp_path: Path, source: Path, **changes) -> Path:
    """A model dir whose config.json is `source`'s with `changes` (no weights: validate reads none)."""
    out = tmp_path / "model"
    out.mkdir()
    config = json.loads((source / "config.json").read_text())
    config.update(changes)
    (out / "config.json").write_text(json.dumps(config))
    return out


def _tokenizer_dir_without_template(tmp_path: Path, source: Path) -> Path:
    out = tmp_path / "tok"
    out.mkdir()
    os.symlink(source / "tokenizer.json", out / "tokenizer.json")
    config = json.loads((source / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def test_error_no_chat_template_and_override(tmp_path, tiny_dense_target):
    tok_dir = _tokenizer_dir_without_template(tmp_path, tiny_dense_target)
    spec = TargetModelSpec(model_path=str(tiny_dense_target), tokenizer_path=str(tok_dir))
    with pytest.raises(TargetModelError, match="no chat template"):
        spec.validate()
    template = tmp_path / "t.jinja"
    template.write_text(default_chat_template())
    fixed = spec.model_copy(update={"chat_template_path": str(template)})
    assert fixed.validate().template_hash == template_hash(default_chat_template())
    missing = spec.model_copy(update={"chat_template_path": str(tmp_path / "nope.jinja")})
    with pytest.raises(TargetModelError, match="cannot read chat template"):
        missing.load_tokenizer()


def test_error_tokenizer_larger_than_embedding(tmp_path, tiny_dense_target):
    model = _model_dir_with(tmp_path, tiny_dense_target, vocab_size=248_064)
    spec = TargetModelSpec(model_path=str(model), tokenizer_path=str(tiny_dense_target))
    with pytest.raises(TargetModelError, match="248078 tokens but the model's embedding has only 248064"):
        spec.validate()


@pytest.mark.parametrize(
    "ids,match",
    [([1, 8], "out of range"), ([-1, 2], "out of range"), ([1, 1, 2], "duplicates"), ([3, 1], "increasing"), ([], "empty")],
)
def test_error_bad_explicit_layer_ids(tiny_dense_target, ids, match):
    spec = TargetModelSpec(model_path=str(tiny_dense_target), target_layer_ids=ids)
    with pytest.raises(TargetModelError, match=match):
        spec.validate()


def test_explicit_layer_ids_win(tiny_dense_target):
    spec = TargetModelSpec(model_path=str(tiny_dense_target), target_layer_ids=[0, 3, 7], num_target_layers=2)
    assert spec.layer_ids() == [0, 3, 7] and spec.validate().layer_ids == (0, 3, 7)


def test_error_target_too_shallow_for_rule(tmp_path, tiny_dense_target):
    model = _model_dir_with(tmp_path, tiny_dense_target, num_hidden_layers=6, layer_types=["full_attention"] * 6)
    spec = TargetModelSpec(model_path=str(model), tokenizer_path=str(tiny_dense_target))
    with pytest.raises(TargetModelError, match="no 5 distinct layers"):
        spec.validate()
    assert spec.model_copy(update={"num_target_layers": 3}).validate().layer_ids == (1, 2, 3)


def test_mask_token_resolution_and_errors(tiny_dense_target):
    base = TargetModelSpec(model_path=str(tiny_dense_target), mask_token="<|NOPE|>")
    with pytest.raises(TargetModelError, match="mask token '<|NOPE|>' is not in tokenizer"):
        base.validate()
    with pytest.raises(TargetModelError, match="not in tokenizer"):
        base.mask_token_id_resolved()
    added = base.model_copy(update={"add_mask_token": True}).validate()
    assert (added.mask_token, added.mask_token_id, added.tokenizer_vocab_size) == ("<|NOPE|>", 248_078, 248_079)
    published = base.model_copy(update={"mask_token_id": 248_070}).validate()
    assert (published.mask_token, published.mask_token_id) == ("<|audio_start|>", 248_070)
    beyond = base.model_copy(update={"mask_token_id": 248_320})
    with pytest.raises(TargetModelError, match="outside the model's 248320 embedding rows"):
        beyond.validate()


def test_error_missing_model(tmp_path):
    with pytest.raises(TargetModelError, match="cannot read the config"):
        TargetModelSpec(model_path=str(tmp_path / "absent")).validate()
    with pytest.raises(TargetModelError, match="cannot read the config"):
        TargetModelSpec(model_path="some-org/not-in-local-cache").load_config()


def test_spec_fields_are_checked():
    with pytest.raises(ValidationError):
        TargetModelSpec(model_path="x", dtype="float16")
    with pytest.raises(ValidationError):
        TargetModelSpec(model_path="x", num_target_layers=0)
    with pytest.raises(ValidationError):
        TargetModelSpec(model_path="x", draft_layers=5)
    spec = TargetModelSpec(model_path="x")
    with pytest.raises(ValidationError):
        spec.dtype = "float32"
    assert TargetModelSpec.model_validate_json(spec.model_dump_json()) == spec


def test_config_fingerprint(tmp_path, tiny_dense_target):
    spec = TargetModelSpec(model_path=str(tiny_dense_target))
    fp = spec.config_fingerprint()
    assert len(fp) == 16 and TargetModelSpec(model_path=str(tiny_dense_target)).config_fingerprint() == fp
    assert spec.model_copy(update={"allow_download": True}).config_fingerprint() == fp  # no output effect
    changed = [
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"target_layer_ids": [1, 2, 3, 4, 5]},  # explicit list is a different recipe even if equal today
        {"num_target_layers": 4},
        {"dtype": "float32"},
        {"mask_token_id": 248_070},
        {"model_path": str(tmp_path)},
    ]
    fps = {spec.model_copy(update=u).config_fingerprint() for u in changed}
    assert fp not in fps and len(fps) == len(changed)

    template = tmp_path / "t.jinja"
    template.write_text(default_chat_template())
    with_file = spec.model_copy(update={"chat_template_path": str(template)})
    same_content = with_file.config_fingerprint()
    assert same_content == fp  # same template text, same outputs
    template.write_text(default_chat_template() + "{#- edited -#}")
    assert with_file.config_fingerprint() != same_content
