"""The packed batch layout (dflash_assets.drafter.data.Batch, packed=True): every sample's blocks and context in one
row. The same loss and gradients as the padded layout (float32, both objectives), the flex BlockMask of a packed row
equal to the dense mask, every anchor trained once, few widths, and the padded shares a training run reports."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_assets.drafter.data import (PACKED_BLOCK_WIDTHS_PER_DOUBLING, PACKED_CONTEXT_WIDTHS_PER_DOUBLING, Sample,
                                        bucket_width, collate, sample_anchors)
from dflash_assets.drafter.loss import (_dflash_mask_mod, dflash_block_mask, dflash_dense_mask, dflash_segmented_mask,
                                        drafter_forward_loss)
from dflash_assets.drafter.model import DFlashDrafter, attend
from tests.drafter.test_model import one_thread, random_head, small_config  # noqa: F401


def unequal_samples(cfg, lengths=(20, 9, 31, 14), counts=(6, 2, 11, 4), seed=0):
    """Samples of unequal lengths and anchor counts, with target features."""
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    samples, anchors = [], []
    for T, n in zip(lengths, counts):
        lm = rng.random(T) < 0.8
        samples.append(Sample(rng.integers(0, cfg.vocab_size - 1, T), lm,
                              torch.randn(T, len(cfg.target_layer_ids) * cfg.hidden_size, generator=g)))
        anchors.append(sample_anchors(lm, cfg.block_size, n, rng))
    return samples, anchors


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("objective", ["dflash", "dpace"])
def test_packed_step_has_the_padded_steps_loss_and_gradients(objective):
    cfg = small_config()
    samples, anchors = unequal_samples(cfg)
    torch.manual_seed(0)
    model, head = DFlashDrafter(cfg), random_head(cfg)
    padded = collate(samples, anchors, seq_multiple=8, anchor_multiple=4)
    packed = collate(samples, anchors, seq_multiple=8, anchor_multiple=4, packed=True)
    assert packed.packed and not padded.packed and packed.anchors.shape[0] == 1
    assert packed.block_slots < padded.block_slots and packed.context_slots < padded.context_slots
    out = {}
    # packed twice: features given in the packed layout, and as per-sample rows (online mode) packed by the forward
    for name, batch, hidden in [("padded", padded, None), ("packed", packed, None),
                                ("packed_rows", packed, padded.hidden)]:
        model.zero_grad(set_to_none=True)
        so = drafter_forward_loss(model, head, batch, block_size=cfg.block_size, mask_token_id=cfg.mask_token_id,
                                  gamma=7.0, objective=objective, hidden=hidden)
        (so.loss_sum / so.weight_sum).backward()
        out[name] = (so, {n: p.grad.clone() for n, p in model.named_parameters()})
    ref, ref_grads = out["padded"]
    for name in ("packed", "packed_rows"):
        so, grads = out[name]
        torch.testing.assert_close(so.loss_sum, ref.loss_sum, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(so.weight_sum, ref.weight_sum, rtol=1e-6, atol=1e-6)
        assert torch.equal(so.count_by_pos, ref.count_by_pos) and torch.equal(so.correct_by_pos, ref.correct_by_pos)
        for n, g in grads.items():
            torch.testing.assert_close(g, ref_grads[n], rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{name} {n}: {m}")
    assert float(ref.weight_sum) > 0 and float(ref.count_by_pos.sum()) > 0
    with torch.no_grad():  # the GPU's attention (flex, its BlockMask over the packed row); forward only on a CPU
        flex = drafter_forward_loss(model, head, packed, block_size=cfg.block_size, mask_token_id=cfg.mask_token_id,
                                    gamma=7.0, objective=objective, attention="flex")
    torch.testing.assert_close(flex.loss_sum, ref.loss_sum, rtol=1e-5, atol=1e-5)


def test_every_anchor_is_trained_once_with_few_widths():
    cfg = small_config(block_size=16)
    samples, anchors = unequal_samples(cfg, lengths=(300, 41, 700, 90, 512), counts=(40, 3, 120, 9, 64), seed=3)
    b = collate(samples, anchors, seq_multiple=128, anchor_multiple=8, bucket=True, packed=True)
    kept = [(int(s), int(a)) for s, a, k in zip(b.block_sample[0], b.anchors[0], b.keep[0]) if k]
    want = [(i, int(a)) for i, a in enumerate(anchors) for a in a]
    assert kept == want  # every anchor once, sample by sample, in order
    assert not b.keep[0, len(want):].any() and b.block_slots % 8 == 0 and b.context_slots % 128 == 0
    assert b.block_slots == bucket_width(len(want), 8, PACKED_BLOCK_WIDTHS_PER_DOUBLING) < 1.25 * len(want) + 8
    T = sum(len(s.input_ids) for s in samples)
    assert b.num_tokens == T <= b.context_slots == bucket_width(T, 128, PACKED_CONTEXT_WIDTHS_PER_DOUBLING) < 2 * T
    for i, s in enumerate(samples):  # each sample's features sit at its start, then the next sample's
        start = int(b.ctx_start[i])
        torch.testing.assert_close(b.hidden[0, start:start + len(s.input_ids)], s.hidden, rtol=0, atol=0)
        assert b.ctx_index[0, start:start + len(s.input_ids)].tolist() == [i * b.input_ids.shape[1] + t
                                                                           for t in range(len(s.input_ids))]
    padded = collate(samples, anchors, seq_multiple=128, anchor_multiple=8, bucket=True)
    assert padded.block_slots > 2 * b.block_slots  # the padded layout computes every sample at the largest count
    widths = {bucket_width(n, 8, PACKED_BLOCK_WIDTHS_PER_DOUBLING) for n in range(800, 1600)}
    assert sorted(widths) == [8 * k for k in (112, 128, 160, 192, 224)]  # four widths per doubling
    assert {bucket_width(n, 128, PACKED_CONTEXT_WIDTHS_PER_DOUBLING) for n in range(5000, 20000)} == {
        128 * 64, 128 * 128, 128 * 256}  # powers of two


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_packed_flex_block_mask_equals_the_dense_mask():
    """Tile-aligned packed row (blocks of several samples in one 128-query tile): the analytic tile lists cover
    every tile create_block_mask finds, with the same full tiles, and flex with them equals SDPA with the dense
    mask, as does SDPA in pieces (`SegmentedMask`)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    cfg = small_config(block_size=16)
    samples, anchors = unequal_samples(cfg, lengths=(300, 41, 350, 90), counts=(8, 8, 8, 5), seed=1)
    rng = np.random.default_rng(1)
    for i, first in ((0, 200), (2, 260)):  # anchors late in their sample: some context tiles are seen whole
        samples[i].loss_mask[:first] = False
        anchors[i] = sample_anchors(samples[i].loss_mask, 16, 8, rng)
    b = collate(samples, anchors, seq_multiple=128, anchor_multiple=8, packed=True)
    B, Sc, nb = 16, b.context_slots, b.block_slots
    starts = b.ctx_start[b.block_sample]
    bm = dflash_block_mask(b.anchors, b.keep, Sc, B, starts=starts)
    ref = create_block_mask(_dflash_mask_mod(b.anchors, b.keep, Sc, B, starts), B=1, H=None, Q_LEN=nb * B,
                            KV_LEN=Sc + nb * B)

    def tiles(num, idx):
        return [set(idx[0, 0, q, : num[0, 0, q]].tolist()) for q in range(num.shape[2])]

    mine, theirs = tiles(bm.kv_num_blocks, bm.kv_indices), tiles(ref.kv_num_blocks, ref.kv_indices)
    full = tiles(bm.full_kv_num_blocks, bm.full_kv_indices)
    assert full == tiles(ref.full_kv_num_blocks, ref.full_kv_indices) and any(full)
    assert all(t <= m for m, t in zip(mine, theirs)) and sum(map(len, mine)) <= sum(map(len, theirs)) + 2
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, nb * B, 8, generator=g)
    k = torch.randn(1, 2, Sc + nb * B, 8, generator=g)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q, k, k, attn_mask=dflash_dense_mask(b.anchors, b.keep, Sc, B, starts=starts), enable_gqa=True)
    torch.testing.assert_close(flex_attention(q, k, k, block_mask=bm, enable_gqa=True), dense, rtol=1e-5, atol=1e-5)
    pieces = dflash_segmented_mask(b.anchors, b.keep, b.block_sample, b.ctx_start, Sc, B)  # the CPU path
    assert len(pieces.pieces) == 5  # runs of at most 8 blocks of one sample (8, 8, 8, 5), then the padding blocks
    torch.testing.assert_close(attend(q, k, k, pieces), dense, rtol=1e-5, atol=1e-5)


def test_training_reports_the_padded_shares_and_trains_the_same_run(tmp_path):
    """train_drafter packed (the default) and padded on unequal lengths: the same losses; the padded run reports
    the padding it computed, the packed one none (on a CPU the packed totals are not rounded)."""
    from transformers import AutoModelForCausalLM

    from dflash_assets.drafter.recipe import DrafterRecipe
    from dflash_assets.drafter.training import train_drafter
    from tests.drafter.test_model import MINI_MASK, MINI_VOCAB, greedy_sequences, mini_target, write_cache

    tdir = mini_target(tmp_path / "target")
    target = AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32).eval()
    seqs = greedy_sequences(target, n=6, prompt_len=6, new_tokens=30, seed=0, vocab_hi=MINI_VOCAB - 12)
    seqs = [(ids[:n], lm[:n]) for (ids, lm), n in zip(seqs, (36, 14, 25, 36, 19, 30))]
    cache = write_cache(tmp_path / "part-0.safetensors", target, seqs, layer_ids=[1, 3])
    recipe = DrafterRecipe(name="pack", num_layers=1, block_size=4, epochs=1, batch_size=3, max_anchors=12, lr=3e-3,
                           mask_token_id=MINI_MASK, save_every=100, seed=2)
    logs = []
    runs = {p: train_drafter(recipe, [cache], tdir, tmp_path / str(p), packed=p, log=logs.append)
            for p in (False, True)}
    np.testing.assert_allclose(runs[True].losses, runs[False].losses, rtol=1e-5)
    assert runs[True].sequence_tokens == runs[False].sequence_tokens == sum(len(ids) for ids, _ in seqs)
    assert runs[True].draft_tokens == runs[False].draft_tokens > 0
    meta = {p: r.to_metadata() for p, r in runs.items()}
    assert meta[True]["padded_block_share"] == meta[True]["padded_context_share"] == 0.0
    assert meta[False]["padded_block_share"] > 0.1 and meta[False]["padded_context_share"] > 0.1
    assert all(0 <= m["padded_block_share"] < 1 and "padded_context_share" in m for m in logs if "loss" in m)
