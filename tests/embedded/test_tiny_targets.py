"""Tiny targets: layout, loading, speed, the thinking chat format they speak, determinism and atomic builds (how
they are taught the format: test_tiny_target_training.py)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import dflash_assets.embedded.tiny_target_training as TR
import dflash_assets.embedded.tiny_targets as TT
from dflash_assets.target_model.chat_template import default_chat_template
from dflash_assets.target_model.tokenizer import QWEN3_6_MASK_TOKEN_ID, build_qwen3_6_tokenizer, tokenizer_hash

THINK_END, IM_END, ENDOFTEXT = 248_069, 248_046, 248_044

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

    marker = json.loads((path / TT.COMPLETE_MARKER).read_text())
    assert path.name == f"{kind}-{marker['fingerprint']['digest']}" == f"{kind}-{TT.target_fingerprint(kind).digest}"
    training = marker["training"]
    if kind == "hybrid":  # left random on purpose (see TINY_TARGET_TRAINING)
        assert training is None and TT.TINY_TARGET_TRAINING["hybrid"] is None
        return
    settings = TT.TINY_TARGET_TRAINING[kind]
    assert training["settings"] == json.loads(json.dumps(dataclasses.asdict(settings)))
    checks = training["format_checks"]  # the build's own format check passed, after as many rounds as it took
    assert checks[0]["steps"] == settings.steps > 0 and checks[0]["prompts"] == settings.check_prompts
    assert checks[-1]["well_formed"] >= settings.min_well_formed * settings.check_prompts
    assert len(training["losses"]) == -(-settings.steps // 25) + (len(checks) - 1) * -(-settings.extra_steps // 25)
    assert training["final_loss"] < training["initial_loss"] / 3 and training["num_samples"] == settings.max_samples
    assert "ShareGPT" in training["data"]


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


PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a Python function that reverses a linked list."}],
    [{"role": "user", "content": "用三句话介绍一下长城。"}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Explique-moi la photosynthèse simplement."}],
    [{"role": "user", "content": "hi"}],
    [{"role": "user", "content": "Summarize this: " + "The quarterly report shows revenue growth in every region, "
      "while costs stayed flat and the new product line sold out twice. " * 8}],
    [{"role": "user", "content": "Give me three ideas for a birthday party."},
     {"role": "assistant", "content": "A picnic, a movie night, or a board game evening."},
     {"role": "user", "content": "Which one is cheapest?"}],
    [{"role": "user", "content": "How do I fix 'ModuleNotFoundError: No module named numpy'?"}],
]


def _generate(model, tok, prompts, max_new_tokens, **sampling):
    """New ids per prompt (one left-padded batch), cut after the first stop token."""
    batch = tok.apply_chat_template(prompts, add_generation_prompt=True, padding=True, return_tensors="pt",
                                    return_dict=True)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=max_new_tokens, **sampling)
    rows = []
    for row in out[:, batch["input_ids"].shape[1]:].tolist():
        stops = [i for i, t in enumerate(row) if t in (IM_END, ENDOFTEXT)]
        rows.append(row[: stops[0] + 1] if stops else row)
    return rows


def _well_formed(tok, ids, max_new_tokens):
    """`</think>`, then an answer of >= 5 tokens, >= 16 tokens after `<think>\\n`, stopped by `<|im_end|>`."""
    if not ids or ids[-1] != IM_END or len(ids) >= max_new_tokens or THINK_END not in ids:
        return False
    answer = tok.decode(ids[ids.index(THINK_END) + 1 : -1], skip_special_tokens=True).strip()
    return THINK_END not in ids[ids.index(THINK_END) + 1 :] and len(tok.encode(answer)) >= 5 and len(ids) >= 16


@pytest.fixture(scope="module")
def dense_model_and_tokenizer(tiny_dense_target):
    tok = AutoTokenizer.from_pretrained(tiny_dense_target, padding_side="left")
    return AutoModelForCausalLM.from_pretrained(tiny_dense_target).eval(), tok


@pytest.mark.parametrize("mode", ["sampled", "greedy"])
def test_dense_target_speaks_the_thinking_format(mode, dense_model_and_tokenizer, one_thread):
    model, tok = dense_model_and_tokenizer
    sampling = dict(do_sample=True, temperature=0.6, top_p=0.95) if mode == "sampled" else dict(do_sample=False)
    outs = _generate(model, tok, PROMPTS, 96, **sampling)
    texts = [tok.decode(o) for o in outs]
    ok = [_well_formed(tok, o, 96) for o in outs]
    # Measured at build time (tiny_target_training): 100% of 45 held-out ShareGPT prompts and of 40 of the
    # file's first prompts (cut at 2K tokens), greedy and sampled. Allow one miss among these 8.
    assert sum(ok) >= len(PROMPTS) - 1, texts
    assert all(t.startswith("Okay") for t, good in zip(texts, ok) if good), texts  # the trained reasoning opener


def _trained_rows(kind: str = "dense") -> torch.Tensor:
    """Ids whose lm_head rows training touched: every id in a supervised span of its (deterministic) samples."""
    samples, long_samples = TR.build_samples(build_qwen3_6_tokenizer(), TT.TINY_TARGET_TRAINING[kind])
    return torch.tensor(sorted({i for s in samples + long_samples for i in s.ids[s.start :]}))


def _row_mass(model, sequences, attention_mask, prompt_len, rows, temperatures, ends) -> dict:
    """Per temperature: the probability that `rows` hold at every generated position through each row's
    `<|im_end|>`. The head runs only on those positions (the padding after `<|im_end|>` is most of a batch's, and
    (positions x 248,320) float logits of all of them are gigabytes), once for every temperature."""
    with torch.no_grad():
        hidden = model.model(sequences, attention_mask=attention_mask).last_hidden_state
        kept = torch.cat([hidden[b, prompt_len - 1 : prompt_len + ends[b]] for b in range(len(ends))])
        logits = model.lm_head(kept).float()
    return {t: torch.exp(torch.logsumexp(logits[:, rows] / t, -1) - torch.logsumexp(logits / t, -1))
            for t in temperatures}


def test_im_end_stops_generation_and_trained_rows_dominate(dense_model_and_tokenizer, one_thread):
    model, tok = dense_model_and_tokenizer
    batch = tok.apply_chat_template(PROMPTS, add_generation_prompt=True, padding=True, return_tensors="pt",
                                    return_dict=True)
    n = batch["input_ids"].shape[1]
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=200, do_sample=False)
    rows = out[:, n:].tolist()
    for row in rows:
        assert IM_END in row and row.index(IM_END) < 120  # stopped well before the cap ...
        assert set(row[row.index(IM_END) + 1 :]) <= {ENDOFTEXT}  # ... and nothing but padding after it
    ends = [row.index(IM_END) for row in rows]
    mask = torch.cat([batch["attention_mask"], torch.ones_like(out[:, n:])], dim=1)

    # The lm_head rows training touched (~4K of 248,320) carry nearly all the probability along the greedy
    # answers to PROMPTS, through <|im_end|>. Measured on a fresh build (DFLASH_CACHE=$(mktemp -d), torch 2.13
    # CPU; 323 positions): at temperature 1 min 0.787, 1st percentile 0.810, mean 0.901; at the
    # pipeline's temperature 0.6 min 0.9979, mean 0.9998. The thresholds sit below them by 0.14 / 0.10 (T=1,
    # min / mean) and 0.008 / 0.005 (T=0.6). The same rows of the same architecture untrained (seeded random
    # init) hold 0.016 everywhere (their share of the vocabulary, 4K/248K): the property fails on a random
    # target, asserted below.
    trained = _trained_rows()
    num_output_ids = json.loads((Path(model.name_or_path) / TT.COMPLETE_MARKER).read_text())["training"]["num_output_ids"]
    assert len(trained) == num_output_ids  # the rows recomputed here are the rows the build trained
    # temperature: (lowest, mean). At 1.0: a build that passes its format check at once measures 0.65 / 0.80;
    # a build that needs an extra round (ATEN_CPU_CAPABILITY=default) 0.60 / 0.79.
    bounds = {1.0: (0.55, 0.75), 0.6: (0.99, 0.995)}
    for temperature, mass in _row_mass(model, out, mask, n, trained, bounds, ends).items():
        lowest, mean = bounds[temperature]
        assert mass.min() > lowest and mass.mean() > mean, (temperature, mass.min(), mass.mean())
    torch.manual_seed(0)
    untrained = AutoModelForCausalLM.from_config(TT._make_config("dense"), dtype=torch.bfloat16).eval()
    for temperature, mass in _row_mass(untrained, out, mask, n, trained, bounds, ends).items():
        assert mass.max() < 0.05 < bounds[temperature][0], (temperature, mass.max())  # the property means something
    head = model.get_output_embeddings().weight.float()
    norms = head.norm(dim=-1)
    assert norms[THINK_END] > 5 * norms.median() and norms[IM_END] > 5 * norms.median()


@pytest.mark.slow  # one fresh build (the other process waits on the lock): ~45 s on one core
def test_concurrent_builds_are_atomic_and_deterministic(tmp_path, tiny_dense_target):
    code = "import sys; from dflash_assets.embedded.tiny_targets import tiny_target_path; print(tiny_target_path('dense', sys.argv[1]))"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for _ in range(2)]
    paths = {p.communicate(timeout=600)[0].strip() for p in procs}  # under ATEN_CPU_CAPABILITY=default: ~4 min
    assert all(p.returncode == 0 for p in procs)
    assert len(paths) == 1
    built = Path(paths.pop())
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == [built.name]  # no temp dirs
    assert built.name == tiny_dense_target.name
    fresh, cached = load_file(built / "model.safetensors"), load_file(tiny_dense_target / "model.safetensors")
    assert fresh.keys() == cached.keys() and all(torch.equal(fresh[k], cached[k]) for k in fresh)


def test_reuse_new_key_and_failed_build(tmp_path, monkeypatch):
    calls = []

    def fake_build(kind, out):
        calls.append(kind)
        (out / "config.json").write_text(json.dumps({"kind": kind}))

    monkeypatch.setattr(TT, "_build", fake_build)
    first = TT.tiny_target_path("dense", tmp_path)
    assert TT.tiny_target_path("dense", tmp_path) == first and calls == ["dense"]
    marker = json.loads((first / TT.COMPLETE_MARKER).read_text())
    assert first.name == f"dense-{marker['fingerprint']['digest']}"  # the key is the fingerprint of the build
    assert "dflash_assets.embedded.tiny_target_training" in marker["fingerprint"]["modules"]
    monkeypatch.setitem(TT.TINY_TARGET_SETTINGS, "dense", dict(TT.TINY_TARGET_SETTINGS["dense"], rms_norm_eps=1e-5))
    second = TT.tiny_target_path("dense", tmp_path)
    assert second != first and second.name.startswith("dense-") and calls == ["dense", "dense"]

    def broken_build(kind, out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(TT, "_build", broken_build)
    with pytest.raises(RuntimeError, match="disk full"):
        TT.tiny_target_path("hybrid", tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == sorted([first.name, second.name])


def test_concurrent_first_uses_build_once(tmp_path, monkeypatch):
    import threading

    calls = []

    def slow_build(kind, out):
        calls.append(kind)
        time.sleep(0.3)
        (out / "config.json").write_text("{}")
        return {"steps": 0}

    monkeypatch.setattr(TT, "_build", slow_build)
    paths = []
    threads = [threading.Thread(target=lambda: paths.append(TT.tiny_target_path("dense", tmp_path))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == ["dense"] and len(set(paths)) == 1 and len(paths) == 3
    assert json.loads((paths[0] / TT.COMPLETE_MARKER).read_text())["training"] == {"steps": 0}


def test_default_cache_dir_and_unknown_kind(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    assert TT.default_targets_dir() == tmp_path / "targets"
    with pytest.raises(ValueError, match="unknown tiny target kind"):
        TT.tiny_target_path("moe")  # type: ignore[arg-type]
