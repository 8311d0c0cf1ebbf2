"""The DFlash conventions of a target: the layer rule (evenly spaced from 1 to L-3), the mask token (explicit, by
name, or the tokenizer's declared one; read from a model directory without a tokenizer load), and the chat
conventions read off a template by rendering probe messages."""

from __future__ import annotations

import json

import pytest

from dflash_assets.target_model.conventions import (MASK_TOKEN, TargetModelError, derive_chat_conventions,
                                                    dflash_target_layer_ids, mask_token_id_in_dir,
                                                    resolve_mask_token_id)


@pytest.mark.parametrize("layers,n,ids", [(36, 5, [1, 9, 17, 25, 33]), (64, 5, [1, 16, 31, 46, 61]),
                                          (8, 1, [4]), (8, 3, [1, 3, 5])])
def test_target_layers_are_evenly_spaced_from_one_to_l_minus_three(layers, n, ids):
    assert dflash_target_layer_ids(layers, n) == ids


@pytest.mark.parametrize("layers,n", [(4, 5), (0, 1), (36, 0)])
def test_a_target_too_shallow_for_the_rule_is_refused(layers, n):
    with pytest.raises(TargetModelError):
        dflash_target_layer_ids(layers, n)


def test_mask_token_explicit_then_by_name_then_declared():
    vocab = {MASK_TOKEN: 7, "<mask>": 9}.get
    assert resolve_mask_token_id(3, vocab) == 3
    assert resolve_mask_token_id(None, vocab) == 7
    assert resolve_mask_token_id(None, {"<mask>": 9}.get, declared="<mask>") == 9
    with pytest.raises(TargetModelError, match="declares no mask_token"):
        resolve_mask_token_id(None, {}.get)


def test_mask_token_of_a_model_directory_without_loading_its_tokenizer(tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": [{"id": 5, "content": "<mask>"}]}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"mask_token": {"content": "<mask>"}}))
    assert mask_token_id_in_dir(tmp_path) == 5
    assert mask_token_id_in_dir(tmp_path, explicit=11) == 11


def test_the_tokenizer_file_is_parsed_once_per_version(tmp_path):
    """Training asks for the mask id at every start (a preflight: once per chunk of steps); the added tokens of
    a file are parsed once, and a file replaced in place (another target written to the directory) is read
    again."""
    from dflash_assets.target_model import conventions

    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"added_tokens": [{"id": 5, "content": MASK_TOKEN}, {"id": 9, "content": MASK_TOKEN}]}))
    misses = conventions._added_tokens.cache_info().misses
    assert [mask_token_id_in_dir(tmp_path) for _ in range(3)] == [5, 5, 5]  # the first entry, as a scan finds it
    assert conventions._added_tokens.cache_info().misses == misses + 1
    replacement = tmp_path / "tokenizer.json.tmp"
    replacement.write_text(json.dumps({"added_tokens": [{"id": 7, "content": MASK_TOKEN}]}))
    replacement.replace(path)
    assert mask_token_id_in_dir(tmp_path) == 7
    path.unlink()
    with pytest.raises(TargetModelError, match="not in tokenizer"):
        mask_token_id_in_dir(tmp_path)


def _chatml(messages, add_generation_prompt, enable_thinking=True):
    """ChatML whose thinking-off turns open with an empty think block (as Qwen3's template does)."""
    empty_think = "" if enable_thinking else "<think>\n\n</think>\n\n"
    text = "".join(f"<|im_start|>{m['role']}\n{empty_think if m['role'] == 'assistant' else ''}{m['content']}"
                   "<|im_end|>\n" for m in messages)
    if add_generation_prompt:
        text += "<|im_start|>assistant\n" + empty_think
    return text


def test_chat_conventions_are_read_off_the_template():
    conventions = derive_chat_conventions(_chatml)
    assert conventions.assistant_header == "<|im_start|>assistant\n" and conventions.end_of_turn == "<|im_end|>\n"
    assert conventions.thinking_supported and conventions.thinking
    off = derive_chat_conventions(_chatml, {"enable_thinking": False})
    assert off.thinking_supported and not off.thinking
    assert off.assistant_header == "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_a_template_without_a_generation_prompt_is_refused():
    with pytest.raises(TargetModelError, match="no generation prompt"):
        derive_chat_conventions(lambda messages, add_generation_prompt, **kw: _chatml(messages, False))
