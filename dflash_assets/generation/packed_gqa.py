"""SDPA for batched decoding without copying the KV cache per query head (grouped-query attention, packed).

A model with grouped-query attention (SmolLM2-135M: 9 query heads over 3 KV heads) has Transformers' SDPA
path expand the cached keys and values to every query head (`repeat_kv`) whenever an attention mask is given,
which a left-padded batch always has, and under `torch.compile` (the static cache's decode step) it does so
even for one query token. For a decode step that copies the whole KV cache `groups` times per layer: at 1,024
rows of 512 cached tokens in bfloat16, ~1.2 GB a layer written and read again, where the attention itself
reads 0.4 GB.

`packed_gqa_sdpa` instead folds the query heads of one KV group into the query-length axis: a (batch, heads,
1, dim) query becomes (batch, kv_heads, groups, dim), attends over the cache as it is, and is unfolded again.
The padding mask (batch, 1, 1, keys) is the same for every query row, so it broadcasts. The result is the
same attention (the tests compare it with Transformers' own path, eager and compiled); any other call
(prefill, one KV head per query head, a per-head mask, dropout, a position bias) goes to Transformers' SDPA
unchanged. A flex-attention `BlockMask` as the mask (slot decoding's rows of their own lengths: key blocks past
a row's position are skipped, not masked) goes to ``flex_attention`` with the query heads grouped over the KV
heads, compiled on CUDA. A packed row (``cu_seq_lens_q``: slot decoding's prefill of many prompts one after
another) goes to ``target_model.packed_attention`` (flash varlen on CUDA). `register()` adds it to
Transformers' attention and mask registries under `ATTENTION_NAME`;
`TransformersEngine(attention="packed_gqa")` sets it on the loaded model. Reads and writes nothing.
"""

from __future__ import annotations

from typing import Any

from dflash_assets.torch_compile import flex_attention, is_block_mask

__all__ = ["ATTENTION_NAME", "packed_gqa_sdpa", "register"]

ATTENTION_NAME = "packed_gqa_sdpa"  # no "flash" in it: Transformers reads such names as flash-attention kernels


def _flex(query, key, value, block_mask, scaling: float | None):
    """flex attention over `block_mask`, one compile per (rows, positions) view on CUDA."""
    return flex_attention(query, key, value, block_mask, scale=scaling, static_shapes=True)


def packed_gqa_sdpa(module: Any, query, key, value, attention_mask, dropout: float = 0.0,
                    scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """Transformers' attention-function signature: returns (output (batch, q_len, heads, dim), None)."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if kwargs.get("cu_seq_lens_q") is not None:  # a packed prefill: the prompts one after another in one row
        from dflash_assets.target_model.packed_attention import packed_causal_attention

        return packed_causal_attention(module, query, key, value, None, scaling=scaling, **kwargs)
    if is_block_mask(attention_mask):
        return _flex(query, key, value, attention_mask, scaling).transpose(1, 2).contiguous(), None
    groups = getattr(module, "num_key_value_groups", 1)
    per_head_mask = attention_mask is not None and attention_mask.shape[1] != 1
    if (groups == 1 or query.shape[2] != 1 or dropout or per_head_mask or key.shape[1] * groups != query.shape[1]
            or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    batch, heads, _, dim = query.shape
    # query head h reads KV head h // groups (repeat_kv's order), so heads of one group are adjacent
    packed = query.reshape(batch, heads // groups, groups, dim)
    out = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask,
                                                           scale=scaling)
    return out.reshape(batch, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def register() -> str:
    """Make `ATTENTION_NAME` a Transformers attention implementation (masks built as for SDPA); idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, packed_gqa_sdpa)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    return ATTENTION_NAME
