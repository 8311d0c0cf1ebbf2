"""The train/serve match check: a real checkpoint saved by the trainer's `save_drafter` for the
tiny dense target passes; each wrong field SGLang 0.5.23's DFlash loader reads (or silently ignores) fails with
what differs; the served target's chat template and thinking mode are compared with the provenance's."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_assets.drafter.model import DFlashDrafter, DrafterConfig, load_target_config, save_drafter
from dflash_assets.drafter.provenance import target_identity
from dflash_assets.drafter.serving_match import (
    check_serving_match,
    checkpoint_serving_match,
    safetensors_header,
    served_target_from_spec,
)
from dflash_assets.store import layout
from dflash_assets.store.manifest import publish_files
from dflash_assets.target_model.conventions import mask_token_id_in_dir
from dflash_assets.target_model.spec import TargetModelSpec


@pytest.fixture(scope="module")
def spec(tiny_dense_target):
    return TargetModelSpec(model_path=str(tiny_dense_target), dtype="float32")


@pytest.fixture(scope="module")
def served(spec):
    return served_target_from_spec(spec)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_dense_target, spec):
    """A real drafter checkpoint for the tiny target (5 layers, block 16, bf16) and its provenance."""
    cfg = DrafterConfig.from_target_config(load_target_config(tiny_dense_target),
                                           mask_token_id=mask_token_id_in_dir(tiny_dense_target))
    torch.manual_seed(0)
    out = save_drafter(DFlashDrafter(cfg), tmp_path_factory.mktemp("ckpt") / "drafter")
    provenance = {"target": target_identity(spec), "recipe": {"block_size": 16}}
    (out / "provenance.json").write_text(json.dumps(provenance))
    return out


def _parts(checkpoint: Path):
    config = json.loads((checkpoint / "config.json").read_text())
    tensors = safetensors_header(checkpoint / "model.safetensors")
    provenance = json.loads((checkpoint / "provenance.json").read_text())
    return config, tensors, provenance


def test_the_trainers_checkpoint_matches_the_served_target(checkpoint, served):
    config, tensors, provenance = _parts(checkpoint)
    report = check_serving_match(config, tensors, served, provenance, trained_block_size=16)
    assert report.passed, report.problems
    assert report.checked == ["architectures", "num_hidden_layers", "hidden_size", "block_size", "target_layer_ids",
                              "mask_token_id", "tensors", "dtype", "chat_template_and_thinking"]
    assert report.facts["target_layer_ids"] == [1, 2, 3, 4, 5] and report.facts["block_size"] == 16
    assert report.facts["mask_token_id"] == served.token_ids["<|MASK|>"]  # the tokenizer's <|MASK|>
    assert report.facts["dtype"] == ["BF16"]


def _set(path, value):
    def change(config):
        node = config
        for key in path[:-1]:
            node = node[key]
        if value is _DELETE:
            del node[path[-1]]
        else:
            node[path[-1]] = value
    return change


_DELETE = object()

CONFIG_CASES = {
    "architecture": (_set(["architectures"], ["Qwen3ForCausalLM"]), "architectures is ['Qwen3ForCausalLM']"),
    "block size": (_set(["block_size"], 8), "block_size 8 in config.json differs from the trained block size 16"),
    "block size missing": (_set(["block_size"], _DELETE), "block_size missing"),
    "layer ids": (_set(["dflash_config", "target_layer_ids"], [1, 2, 3, 4, 6]),
                  "target_layer_ids [1, 2, 3, 4, 6] differ from the served target's layers [1, 2, 3, 4, 5]"),
    "layer ids out of range": (_set(["dflash_config", "target_layer_ids"], [1, 2, 3, 4, 9]), "out of range"),
    "layer ids missing": (_set(["dflash_config", "target_layer_ids"], _DELETE), "target_layer_ids missing"),
    "num target layers": (_set(["num_target_layers"], 36), "num_target_layers 36 differs"),
    "mask id conflicts with the tokenizer": (_set(["dflash_config", "mask_token_id"], 5),
                                             "mask_token_id 5 conflicts with the served tokenizer's id"),
    "mask id outside the vocab": (_set(["dflash_config", "mask_token_id"], 10_000_000), "outside the served target"),
    "mask id missing": (_set(["dflash_config", "mask_token_id"], _DELETE), "mask_token_id missing"),
    "mask id negative": (_set(["dflash_config", "mask_token_id"], -1), "must be a non-negative integer"),
    "hidden size": (_set(["hidden_size"], 128), "hidden_size 128 differs from the served target's 64"),
    "dtype": (_set(["dtype"], "float32"), "config.json says dtype 'float32' but the tensors are BF16"),
    "layer count": (_set(["num_hidden_layers"], 6), "tensors missing from model.safetensors: layers.5."),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_a_wrong_config_field_blocks_with_what_differs(case, checkpoint, served):
    config, tensors, provenance = _parts(checkpoint)
    change, expected = CONFIG_CASES[case]
    change(config)
    report = check_serving_match(config, tensors, served, provenance, trained_block_size=16)
    assert not report.passed
    assert any(expected in p for p in report.problems), report.problems


def _rewrite(checkpoint: Path, tmp_path: Path, edit) -> Path:
    tensors = load_file(str(checkpoint / "model.safetensors"))
    edit(tensors)
    out = tmp_path / "model.safetensors"
    save_file(tensors, str(out))
    return out


def test_an_embedding_or_head_in_the_checkpoint_blocks(checkpoint, served, tmp_path):
    config, _, provenance = _parts(checkpoint)
    for name in ("embed_tokens.weight", "lm_head.weight", "model.embed_tokens.weight"):
        path = _rewrite(checkpoint, tmp_path, lambda t: t.update({name: torch.zeros(8, 64, dtype=torch.bfloat16)}))
        report = check_serving_match(config, safetensors_header(path), served, provenance, trained_block_size=16)
        assert report.problems == [f"{name} is in the checkpoint: SGLang ignores it and uses the target's "
                                   f"(dflash.py:943-946); the drafter must not carry its own embedding or head"]


def test_missing_tensors_mixed_dtypes_and_a_wrong_fc_shape_block(checkpoint, served, tmp_path):
    config, _, provenance = _parts(checkpoint)
    path = _rewrite(checkpoint, tmp_path, lambda t: t.pop("hidden_norm.weight"))
    report = check_serving_match(config, safetensors_header(path), served, provenance, trained_block_size=16)
    assert report.problems == ["tensors missing from model.safetensors: hidden_norm.weight"]

    path = _rewrite(checkpoint, tmp_path, lambda t: t.update({"norm.weight": t["norm.weight"].float()}))
    report = check_serving_match(config, safetensors_header(path), served, provenance, trained_block_size=16)
    assert report.problems == ["tensors mix dtypes ['BF16', 'F32']"]

    path = _rewrite(checkpoint, tmp_path, lambda t: t.update({"fc.weight": t["fc.weight"][:, :256].contiguous()}))
    report = check_serving_match(config, safetensors_header(path), served, provenance, trained_block_size=16)
    assert report.problems == ["fc.weight has shape [64, 256], SGLang expects [64, 320] for 5 target layers of "
                               "hidden size 64"]


def test_template_and_thinking_of_the_samples_must_equal_the_served_ones(checkpoint, served):
    import dataclasses

    config, tensors, provenance = _parts(checkpoint)
    other = dataclasses.replace(served, template_hash="0" * 16, thinking=not served.thinking)
    report = check_serving_match(config, tensors, other, provenance, trained_block_size=16)
    assert len(report.problems) == 2
    assert report.problems[0].startswith(f"chat template hash {provenance['target']['chat_template_hash']!r} of the "
                                         f"training samples differs from the served target's '{'0' * 16}'")
    assert "thinking mode" in report.problems[1] and "deployment target settings" in report.problems[1]
    report = check_serving_match(config, tensors, served, None, trained_block_size=16)
    assert report.problems == ["no provenance.json target identity: the chat template and thinking mode the samples "
                               "were made with are unknown"]
    # a server started with another --speculative-num-draft-tokens runs another block size
    report = check_serving_match(config, tensors, dataclasses.replace(served, num_draft_tokens=8), provenance, 16)
    assert report.problems == ["the server runs --speculative-num-draft-tokens 8 but the drafter was trained with "
                               "block size 16"]


def test_a_thinking_off_deployment_differs_from_samples_made_with_thinking(tiny_dense_target, checkpoint):
    """A real second deployment setting: the same target served with enable_thinking off."""
    config, tensors, provenance = _parts(checkpoint)
    off = served_target_from_spec(TargetModelSpec(model_path=str(tiny_dense_target), dtype="float32",
                                                  chat_template_kwargs={"enable_thinking": False}))
    if provenance["target"]["thinking"] == off.thinking:
        pytest.fail("the tiny target's template has no thinking switch; this test needs one")
    report = check_serving_match(config, tensors, off, provenance, trained_block_size=16)
    assert [p for p in report.problems if "thinking mode" in p], report.problems


def test_the_published_checkpoint_is_read_through_its_manifest(checkpoint, served, local_store, tmp_path):
    name = "match-v1"
    files = {f: checkpoint / f for f in ("config.json", "model.safetensors", "provenance.json")}
    publish_files(local_store, layout.drafter_checkpoint_manifest(name), layout.drafter_checkpoint_prefix(name), files)
    assert checkpoint_serving_match(local_store, name, served).passed

    bad = json.loads((checkpoint / "config.json").read_text())
    bad["dflash_config"]["mask_token_id"] = 7
    (tmp_path / "config.json").write_text(json.dumps(bad))
    publish_files(local_store, layout.drafter_checkpoint_manifest(name), layout.drafter_checkpoint_prefix(name),
                  {**files, "config.json": tmp_path / "config.json"})
    report = checkpoint_serving_match(local_store, name, served)
    assert not report.passed and "mask_token_id 7 conflicts" in report.problems[0]
    with pytest.raises(FileNotFoundError, match="materialize drafter_checkpoint first"):
        checkpoint_serving_match(local_store, "never-trained", served)


def test_safetensors_header_is_read_without_the_data(checkpoint):
    raw = (checkpoint / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = safetensors_header(raw[: 8 + n])  # the header alone is enough
    assert header["fc.weight"].shape == (64, 320) and header["fc.weight"].dtype == "BF16"
    with pytest.raises(ValueError, match="not a safetensors"):
        safetensors_header(b"\x01\x00")
