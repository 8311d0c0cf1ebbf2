"""Packed causal attention: samples one after another in a row attend inside their own only, as each alone would;
the same row with one causal attention over it (no boundaries) differs, so a leak would be caught."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_assets.target_model.packed_attention import packed_causal_attention


def test_each_packed_sample_attends_as_it_would_alone():
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 12, 1, 9]
    T = sum(lengths)
    q = torch.randn(1, 6, T, 8, generator=gen)  # 6 query heads over 2 KV heads
    k, v = torch.randn(1, 2, T, 8, generator=gen), torch.randn(1, 2, T, 8, generator=gen)
    cu = torch.tensor([0, 5, 17, 18, 27], dtype=torch.int32)
    out, _ = packed_causal_attention(None, q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=12)
    assert out.shape == (1, T, 6, 8)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True,
                                               enable_gqa=True)
        torch.testing.assert_close(out[:, a:b], alone.transpose(1, 2))
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
    assert (out[:, 5:] - whole[:, 5:]).abs().max() > 1e-2  # past the first sample, one row's attention differs
