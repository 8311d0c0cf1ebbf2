"""Tiny random-weight targets: layout, loading, speed, determinism and atomic builds."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import dflash_assets.tiny_targets as TT
from dflash_assets.chat_template import default_chat_template
from dflash_assets.tokenizer import QWEN3_6_MASK_TOKEN_ID, build_qwen3_6_tokenizer, tokenizer_hash

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Bonjour, 你好 👋"}]


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_layout_config_and_tokenizer(kind, tiny_dense_target, tiny_hybrid_target):
    path = {"dense": tiny_dense_target, "hybrid": tiny_hybrid_target}[kind]
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", "generation_config.json", TT.COMPLETE_MARKER} <= names
    assert not any(n.endswith(".bin") for n in names)
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == {"dense": "qwen3", "hybrid": "qwen3_5_text"}[kind]
    assert config.vocab_size == 248_320 and config.vocab_size % 128 == 0 and config.vocab_size > QWEN3_6_MASK_TOKEN_ID
    assert config.hidden_size == 64 and config.tie_word_embeddings is False
    assert config.num_hidden_layers == 8
    if kind == "hybrid":
        assert set(config.layer_types) == {"linear_attention", "full_attention"} and config.num_hidden_layers == 8

    tok = AutoTokenizer.from_pretrained(path)
    ours = build_qwen3_6_tokenizer()
    assert tok.chat_template == default_chat_template()
    assert tokenizer_hash(tok) == tokenizer_hash(ours)
    assert tok.mask_token_id == QWEN3_6_MASK_TOKEN_ID and tok.eos_token == "<|im_end|>"
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n<think>\n")
    assert tok.encode(text) == ours.encode(text)


@pytest.fixture
def one_thread():
    """OpenMP spin-waits make 2 torch threads 5-10x slower than 1 on a shared, busy 2-core box."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_load_forward_speed_and_greedy_generate(kind, tiny_dense_target, tiny_hybrid_target, one_thread):
    path = {"dense": tiny_dense_target, "hybrid": tiny_hybrid_target}[kind]
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert model.dtype == torch.bfloat16
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert emb.shape == head.shape == (248_320, 64) and emb.data_ptr() != head.data_ptr()
    assert not torch.equal(emb, head)

    ids = torch.randint(0, 248_000, (1, 3072), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids[:, :32], logits_to_keep=1)  # warm-up
        timings = []
        for _ in range(2):
            start = time.perf_counter()
            out = model(ids, logits_to_keep=1, output_hidden_states=True)
            timings.append(time.perf_counter() - start)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    assert out.hidden_states[-2].shape == (1, 3072, 64) and torch.isfinite(out.logits).all()
    # ~0.3 s on one core of a loaded box (~0.1-0.2 s with 2 idle cores); the bound leaves room for
    # a busy CI machine while still catching a target that grew 10x.
    assert min(timings) < 2.5, f"3K-token forward took {min(timings):.2f}s at best"

    tok = AutoTokenizer.from_pretrained(path)
    prompt = tok.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    runs = [model.generate(**prompt, max_new_tokens=8, do_sample=False) for _ in range(2)]
    n = prompt["input_ids"].shape[1]
    assert torch.equal(runs[0], runs[1]) and runs[0].shape[1] > n
    assert torch.equal(runs[0][:, :n], prompt["input_ids"])


@pytest.mark.slow  # two fresh builds: ~7 s idle, ~25 s on a loaded 2-core box
def test_concurrent_builds_are_atomic_and_deterministic(tmp_path, tiny_dense_target):
    code = "import sys; from dflash_assets.tiny_targets import tiny_target_path; print(tiny_target_path('dense', sys.argv[1]))"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for _ in range(2)]
    paths = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(paths) == 1
    built = Path(paths.pop())
    assert [p.name for p in tmp_path.iterdir()] == [built.name]  # no leftover temp dirs
    assert built.name == tiny_dense_target.name
    fresh, cached = load_file(built / "model.safetensors"), load_file(tiny_dense_target / "model.safetensors")
    assert fresh.keys() == cached.keys() and all(torch.equal(fresh[k], cached[k]) for k in fresh)


def test_reuse_version_key_and_failed_build(tmp_path, monkeypatch):
    calls = []

    def fake_build(kind, out):
        calls.append(kind)
        (out / "config.json").write_text(json.dumps({"kind": kind}))

    monkeypatch.setattr(TT, "_build", fake_build)
    first = TT.tiny_target_path("dense", tmp_path)
    assert TT.tiny_target_path("dense", tmp_path) == first and calls == ["dense"]
    monkeypatch.setattr(TT, "TINY_TARGETS_VERSION", "v-test")
    second = TT.tiny_target_path("dense", tmp_path)
    assert second != first and "v-test" in second.name and calls == ["dense", "dense"]

    def broken_build(kind, out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(TT, "_build", broken_build)
    with pytest.raises(RuntimeError, match="disk full"):
        TT.tiny_target_path("hybrid", tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, second.name])


def test_default_cache_dir_and_unknown_kind(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    assert TT.default_targets_dir() == tmp_path / "targets"
    with pytest.raises(ValueError, match="unknown tiny target kind"):
        TT.tiny_target_path("moe")  # type: ignore[arg-type]
