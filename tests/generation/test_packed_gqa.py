"""Packed grouped-query attention (`generation.packed_gqa`): the same attention as Transformers' SDPA, eager and
compiled, without the KV copy per query head; and the in-process engine answering with it as with SDPA."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from dflash_assets.generation.engines import GenerationConfig, TransformersEngine
from dflash_assets.generation.packed_gqa import ATTENTION_NAME, packed_gqa_sdpa


class Attention:  # what the attention function reads of its module
    def __init__(self, groups: int):
        self.num_key_value_groups = groups
        self.training = False


def decode_inputs(batch=5, heads=9, kv_heads=3, keys=40, dim=16, q_len=1):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, q_len, dim, generator=g)
    k, v = torch.randn(batch, kv_heads, keys, dim, generator=g), torch.randn(batch, kv_heads, keys, dim, generator=g)
    mask = torch.ones(batch, 1, q_len, keys, dtype=torch.bool)
    mask[:2, :, :, :11] = False  # two left-padded rows
    return q, k, v, mask


def repeated_reference(q, k, v, mask, groups, scale):
    """Attention with the KV heads copied to every query head (Transformers' `repeat_kv` order), (b, q, h, d)."""
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(1, 2)


def test_one_query_token_attends_as_with_the_cache_copied_to_every_head():
    q, k, v, mask = decode_inputs()
    out, weights = packed_gqa_sdpa(Attention(3), q, k, v, mask, scaling=0.25)
    assert weights is None and out.shape == (5, 1, 9, 16)
    torch.testing.assert_close(out, repeated_reference(q, k, v, mask, 3, 0.25))
    torch.testing.assert_close(out[:2], repeated_reference(q[:2, :, :, :], k[:2, :, 11:], v[:2, :, 11:], None, 3,
                                                           0.25))  # padding is not attended to


def sdpa_key_shapes_when_compiled(fn, *inputs) -> tuple[list[tuple[int, ...]], torch.Tensor]:
    """The key shapes the compiled graph of `fn` passes to SDPA (read from the traced graph), and its output."""
    shapes = []

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "call_function" and "scaled_dot_product_attention" in str(node.target):
                shapes.append(tuple(node.args[1].meta["example_value"].shape))
        return gm.forward

    out = torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    return shapes, out


def test_compiled_packed_attention_reads_the_cache_as_it_is():
    """Under torch.compile (the static cache's decode step) Transformers 5.24's SDPA path hands SDPA the cache
    copied to every query head; the packed function hands it the cache as it is, with the same result."""
    q, k, v, mask = decode_inputs()
    stock_keys, stock = sdpa_key_shapes_when_compiled(
        lambda *t: sdpa_attention_forward(Attention(3), *t, scaling=0.25)[0], q, k, v, mask)
    packed_keys, packed = sdpa_key_shapes_when_compiled(
        lambda *t: packed_gqa_sdpa(Attention(3), *t, scaling=0.25)[0], q, k, v, mask)
    assert stock_keys == [(5, 9, 40, 16)], "Transformers no longer copies the cache when compiled: packed_gqa may go"
    assert packed_keys == [(5, 3, 40, 16)]
    torch.testing.assert_close(packed, stock)
    torch.testing.assert_close(packed, repeated_reference(q, k, v, mask, 3, 0.25))


@pytest.mark.parametrize("case", ["prefill", "no_groups", "per_head_mask", "no_mask"])
def test_other_calls_go_to_transformers_sdpa_unchanged(case):
    q_len = 4 if case == "prefill" else 1
    heads, kv_heads = (3, 3) if case == "no_groups" else (9, 3)
    q, k, v, mask = decode_inputs(heads=heads, kv_heads=kv_heads, q_len=q_len)
    if case == "per_head_mask":
        mask = mask.expand(-1, heads, -1, -1).clone()
        mask[:, 0, :, 20:] = False
    if case == "no_mask":
        mask = None
    module = Attention(heads // kv_heads)
    expected, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    out, _ = packed_gqa_sdpa(module, q, k, v, mask, scaling=0.25)
    torch.testing.assert_close(out, expected)
    if case == "prefill":  # and it still is attention with the cache copied per head
        torch.testing.assert_close(out, repeated_reference(q, k, v, mask, 3, 0.25))


def test_engine_with_packed_attention_answers_as_with_sdpa(tiny_dense_target, monkeypatch):
    """The in-process engine (static and dynamic cache) gives the same greedy answers with attention="packed_gqa",
    its model calls the packed function on every layer's decode steps, and the loaded model is not shared with
    sdpa's."""
    from transformers import AutoTokenizer

    from dflash_assets.generation import packed_gqa

    tok = AutoTokenizer.from_pretrained(str(tiny_dense_target))
    gen = GenerationConfig(max_new_tokens=8, temperature=0.0, enable_thinking=False)
    chats = [[{"role": "user", "content": q}] for q in ("What is 2+2?", "Name a colour.", "Write a long sentence.")]
    decode_calls = []

    def recording(module, query, *args, **kwargs):  # registered in its place when the engine loads its model
        decode_calls.append(query.shape[2] == 1)
        return packed_gqa_sdpa(module, query, *args, **kwargs)

    async def go(cache, attention):
        async with TransformersEngine(tiny_dense_target, tokenizer=tok, max_concurrency=8, cache=cache,
                                      attention=attention) as eng:
            out = await asyncio.gather(*(eng.chat(m, gen) for m in chats))
            return [(r.content, r.completion_tokens, r.finish_reason) for r in out], eng.model.config

    monkeypatch.setattr(packed_gqa, "packed_gqa_sdpa", recording)
    for cache in ("static", "dynamic"):
        stock, stock_config = asyncio.run(go(cache, "sdpa"))
        assert decode_calls == []
        packed, packed_config = asyncio.run(go(cache, "packed_gqa"))
        assert packed == stock, cache
        assert packed_config._attn_implementation == ATTENTION_NAME and stock_config._attn_implementation == "sdpa"
        assert sum(decode_calls) >= 8 * 7, cache  # 8 layers, at least 7 decode steps each
        decode_calls.clear()
    with pytest.raises(ValueError, match="'sdpa' or 'packed_gqa'"):
        TransformersEngine(tiny_dense_target, tokenizer=tok, attention="flash")
    with pytest.raises(ValueError, match="continuous batching"):
        TransformersEngine(tiny_dense_target, tokenizer=tok, cache="continuous", attention="packed_gqa")
