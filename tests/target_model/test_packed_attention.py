"""Packed causal attention: samples one after another in a row attend inside their own only, as each alone would;
the same row with one causal attention over it (no boundaries) differs, so a leak would be caught. `packed_row`
lays samples out so that a real model run over the row gives each sample's logits alone."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_assets.target_model.packed_attention import packed_attention, packed_causal_attention, packed_row


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


def test_packed_row_runs_each_sample_of_a_model_as_alone():
    row = packed_row([3, 1, 4], "cpu")
    assert row["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1, 2, 3]]
    assert row["cu_seq_lens_q"].dtype == torch.int32 and row["cu_seq_lens_q"].tolist() == [0, 3, 4, 8]
    assert row["cu_seq_lens_k"] is row["cu_seq_lens_q"] and row["max_length_q"] == row["max_length_k"] == 4

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)).eval()
    samples = [torch.randint(0, 200, (n,)) for n in (7, 2, 11)]
    with torch.no_grad(), packed_attention(model):
        packed = model(input_ids=torch.cat(samples)[None], **packed_row([7, 2, 11], "cpu"), use_cache=False).logits[0]
        unbounded = model(input_ids=torch.cat(samples)[None], use_cache=False).logits[0]
    with torch.no_grad():
        alone = torch.cat([model(input_ids=s[None], use_cache=False).logits[0] for s in samples])
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-4)
    assert (unbounded[7:] - alone[7:]).abs().max() > 1e-3  # one causal row over all of them would differ
