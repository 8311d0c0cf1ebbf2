"""DFlash drafter model: parameter names, config.json layout, save/load, the draft cache (the attention masks and
the loss are tests/drafter/test_loss.py's).

Also holds the helpers the other drafter test modules import: a small-vocab Qwen3 target
(`mini_target`), the target's own greedy continuations, and a hidden-state cache file written in
the real format (`hidden_state_format`) from HF `output_hidden_states`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dflash_assets.target_model.conventions import dflash_target_layer_ids, mask_token_id_in_dir
from dflash_assets.drafter.model import (
    DFlashDrafter,
    DraftCache,
    DrafterConfig,
    TargetHead,
    load_drafter,
    load_target_config,
    save_drafter,
)
from dflash_assets.drafter.data import Batch, Sample, collate, sample_anchors

# ----------------------------------------------------------------------------------------------
# helpers shared by test_training.py, test_decoding.py, test_target_change.py (this folder) and hidden_states/test_part_cache.py

MINI_VOCAB = 512
MINI_MASK = MINI_VOCAB - 1


@pytest.fixture(autouse=True)
def one_thread():
    """These tests are tiny: one thread avoids oversubscription on a shared 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def mini_target(out_dir: Path, seed: int = 0, layers: int = 6) -> Path:
    """A small-vocab (512) random Qwen3 target in fp32, saved with save_pretrained (safetensors)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if (out_dir / "config.json").exists():
        return out_dir
    cfg = Qwen3Config(vocab_size=MINI_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                      tie_word_embeddings=False, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(seed)
    Qwen3ForCausalLM(cfg).eval().save_pretrained(out_dir)
    return out_dir


def greedy_sequences(target, n: int, prompt_len: int, new_tokens: int, seed: int, vocab_hi: int):
    """(input_ids, loss_mask) pairs: a random prompt + the target's own greedy continuation."""
    from dflash_assets.drafter.decoding import greedy_generate

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        prompt = torch.randint(0, vocab_hi, (prompt_len,), generator=g).tolist()
        cont = greedy_generate(target, prompt, new_tokens)
        out.append((prompt + cont, [0] * prompt_len + [1] * len(cont)))
    return out


def write_cache(path: Path, target, seqs, layer_ids, dtype=torch.float32) -> Path:
    """A hidden-state cache partition in the real format, features from HF output_hidden_states."""
    from dflash_assets.hidden_states.format import SafetensorsStreamWriter, ShardMetadata, shard_tensor_specs

    H = target.config.hidden_size
    T = sum(len(ids) for ids, _ in seqs)
    meta = ShardMetadata(target_model="test", layer_ids=tuple(layer_ids), dtype=str(dtype).removeprefix("torch."),
                         hidden_size=H, prompt_ids=tuple(f"p{i}" for i in range(len(seqs))))
    cu = [0]
    with SafetensorsStreamWriter(path, shard_tensor_specs(T, len(seqs), len(layer_ids), H, dtype),
                                 meta.to_header(), fsync=False) as w:
        for ids, lm in seqs:
            with torch.no_grad():
                hs = target(torch.tensor([ids]), output_hidden_states=True).hidden_states
            w.write("hidden", torch.cat([hs[i + 1][0] for i in layer_ids], -1).to(dtype).contiguous())
            w.write("input_ids", torch.tensor(ids, dtype=torch.int32))
            w.write("loss_mask", torch.tensor(lm, dtype=torch.uint8))
            cu.append(cu[-1] + len(ids))
        w.write("cu_seqlens", torch.tensor(cu, dtype=torch.int64))
    return path


def publish_cache(store, cache: Path, shard: str = "shard-00000") -> None:
    """`cache` (a `write_cache` file) published in `store` as `shard`'s hidden-state partition."""
    from dflash_assets.store import layout
    from dflash_assets.store.manifest import publish_files

    publish_files(store, layout.hidden_state_manifest(shard), layout.hidden_state_versions(shard),
                  {f"{shard}.safetensors": cache})


def publish_tiny_cache(store, tmp: Path, target_dir) -> tuple[object, Path]:
    """The tiny target's greedy continuations of 8 random prompts as one published hidden-state shard
    (shard-00000, layer 1): what a drafter test trains on. Returns (the loaded target, the cache file)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    seqs = greedy_sequences(model, n=8, prompt_len=8, new_tokens=24, seed=0, vocab_hi=200)
    cache = write_cache(tmp / "cache.safetensors", model, seqs, layer_ids=[1])
    publish_cache(store, cache)
    return model, cache


def small_config(**kw) -> DrafterConfig:
    d = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             vocab_size=64, target_layer_ids=[1, 3], num_target_layers=6, mask_token_id=63, num_hidden_layers=2,
             block_size=4)
    d.update(kw)
    return DrafterConfig(**d)


def random_head(config: DrafterConfig, seed: int = 0) -> TargetHead:
    g = torch.Generator().manual_seed(seed)
    V, H = config.vocab_size, config.hidden_size
    return TargetHead(torch.randn(V, H, generator=g), torch.randn(V, H, generator=g) * 0.1)


def random_batch(config: DrafterConfig, lengths=(20, 13), n_anchors=4, seed=0) -> Batch:
    rng = __import__("numpy").random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    n = len(config.target_layer_ids)
    samples, anchors = [], []
    for T in lengths:
        ids = rng.integers(0, config.vocab_size - 1, T)
        lm = rng.random(T) < 0.8
        samples.append(Sample(ids, lm, torch.randn(T, n * config.hidden_size, generator=g)))
        anchors.append(sample_anchors(lm, config.block_size, n_anchors, rng))
    return collate(samples, anchors)


# ----------------------------------------------------------------------------------------------
# layer ids, config, names


def test_dflash_target_layer_ids():
    assert dflash_target_layer_ids(36) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert dflash_target_layer_ids(64) == [1, 16, 31, 46, 61]  # Qwen3.6-27B
    assert dflash_target_layer_ids(8) == [1, 2, 3, 4, 5]  # the tiny targets


def test_config_from_tiny_targets(tiny_dense_target, tiny_hybrid_target):
    from dflash_assets.target_model.tokenizer import QWEN3_6_MASK_TOKEN_ID  # <|MASK|> in the target's tokenizer.json

    for target in (tiny_dense_target, tiny_hybrid_target):
        cfg = DrafterConfig.from_target_config(load_target_config(target), mask_token_id=mask_token_id_in_dir(target))
        assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (64, 4, 2, 16)
        assert cfg.target_layer_ids == [1, 2, 3, 4, 5] and cfg.num_target_layers == 8
        assert cfg.mask_token_id == QWEN3_6_MASK_TOKEN_ID and cfg.vocab_size == 248320
    assert mask_token_id_in_dir(tiny_dense_target, 7) == 7  # an explicit id wins
    with pytest.raises(ValueError, match="mask_token_id"):  # no silent family default
        DrafterConfig.from_target_config(load_target_config(tiny_dense_target))
    with pytest.raises(ValueError, match="not in tokenizer"):
        mask_token_id_in_dir(tiny_dense_target, mask_token="<|NOPE|>")


def test_parameter_names_exactly_the_public_ones():
    cfg = small_config(num_hidden_layers=2)
    names = set(DFlashDrafter(cfg).state_dict())
    expected = {"norm.weight", "fc.weight", "hidden_norm.weight"}
    for i in range(2):
        p = f"layers.{i}."
        expected |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
        expected |= {p + f"self_attn.{x}_norm.weight" for x in "qk"}
        expected |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        expected |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
    assert names == expected  # no embed_tokens / lm_head / rotary buffers
    m = DFlashDrafter(cfg)
    assert m.fc.weight.shape == (32, 2 * 32) and m.fc.bias is None


def test_checkpoint_layout_loads_as_qwen3_config(tmp_path):
    from transformers import Qwen3Config

    cfg = small_config(bos_token_id=1, eos_token_id=[2, 3])
    out = save_drafter(DFlashDrafter(cfg), tmp_path / "ckpt")
    d = json.loads((out / "config.json").read_text())
    assert d["architectures"] == ["DFlashDraftModel"]
    assert d["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert d["model_type"] == "qwen3" and d["block_size"] == 4 and d["num_target_layers"] == 6
    assert d["dflash_config"] == {"mask_token_id": 63, "target_layer_ids": [1, 3]}
    assert d["layer_types"] == ["full_attention"] * 2 and d["tie_word_embeddings"] is False
    q = Qwen3Config.from_pretrained(out)  # what the public inference code builds the model from
    assert q.hidden_size == 32 and q.num_hidden_layers == 2 and q.head_dim == 8
    assert q.dflash_config["target_layer_ids"] == [1, 3] and q.block_size == 4
    assert q.rope_parameters["rope_theta"] == cfg.rope_theta
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(DFlashDrafter(cfg).state_dict())
        assert f.metadata()["format"] == "pt"
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temp dirs left behind


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_load_round_trips_exactly(tmp_path, dtype):
    cfg = small_config()
    torch.manual_seed(3)
    m = DFlashDrafter(cfg)
    with torch.no_grad():  # non-trivial norm weights too
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    save_drafter(m, tmp_path / "a", dtype=dtype)
    back = load_drafter(tmp_path / "a")
    assert back.config == cfg
    want = {k: v.to(dtype) for k, v in m.state_dict().items()}
    got = back.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert got[k].dtype == dtype and torch.equal(got[k], want[k]), k
    # the same forward, bit for bit, once both are in the same dtype
    b = random_batch(cfg)
    head = random_head(cfg)
    ref = m.to(dtype)
    for model in (ref, back):
        model.eval()
    x = head.embed(b.input_ids[:, :4]).to(dtype)
    pos = torch.arange(b.input_ids.shape[1] + 4).expand(2, -1)
    torch.testing.assert_close(back(x, b.hidden.to(dtype), pos), ref(x, b.hidden.to(dtype), pos), rtol=0, atol=0)
    # a second save over the same directory replaces it atomically
    save_drafter(back, tmp_path / "a", dtype=dtype)
    assert load_drafter(tmp_path / "a").config == cfg


def test_target_head_comes_from_target_weights(tiny_dense_target):
    from transformers import AutoModelForCausalLM

    head = TargetHead.from_target_dir(tiny_dense_target, dtype=torch.float32)
    target = AutoModelForCausalLM.from_pretrained(tiny_dense_target, dtype=torch.float32)
    assert torch.equal(head.embed_tokens.weight, target.get_input_embeddings().weight)
    assert torch.equal(head.lm_head.weight, target.get_output_embeddings().weight)
    assert not torch.equal(head.embed_tokens.weight, head.lm_head.weight)  # untied: both read correctly
    assert not any(p.requires_grad for p in head.parameters())


# ----------------------------------------------------------------------------------------------
# the draft cache: incremental rounds equal the full context


def test_draft_cache_equals_full_context():
    cfg = small_config()
    torch.manual_seed(2)
    m = DFlashDrafter(cfg).eval()
    head = random_head(cfg)
    hidden = torch.randn(1, 12, 2 * cfg.hidden_size)
    block = torch.tensor([[5] + [cfg.mask_token_id] * 3])
    x = head.embed(block)
    with torch.no_grad():
        cache = DraftCache(2)
        m(x, hidden[:, :7], torch.arange(7 + 4)[None], cache=cache)  # first round: context 0..6
        inc = m(x, hidden[:, 7:12], torch.arange(7, 12 + 4)[None], cache=cache)  # second: adds 7..11
        full = m(x, hidden, torch.arange(12 + 4)[None])
    assert cache.length == 12
    torch.testing.assert_close(inc, full, rtol=1e-5, atol=1e-6)


