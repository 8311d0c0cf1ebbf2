"""The drafter's attention masks and loss (dflash_assets.drafter.loss): the dense mask's semantics, the flex block
mask equal to it (and to create_block_mask's tiles), the packed training layout equal to per-block inference,
decayed block labels, and the chunked head cross-entropy equal to torch's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_assets.drafter.data import sample_anchors
from dflash_assets.drafter.loss import block_labels, dflash_dense_mask, drafter_forward_loss, head_cross_entropy
from dflash_assets.drafter.model import DFlashDrafter
from tests.drafter.test_model import one_thread, random_batch, random_head, small_config  # noqa: F401


def test_dense_mask_semantics():
    anchors = torch.tensor([[2, 5, 0]])
    keep = torch.tensor([[True, True, False]])
    S, B = 8, 3
    m = dflash_dense_mask(anchors, keep, S, B)[0, 0]  # (9, 17)
    for q in range(9):
        blk = q // B
        for kv in range(S + 9):
            if kv < S:
                want = bool(keep[0, blk]) and kv < int(anchors[0, blk])  # context strictly before the anchor
            else:
                want = (kv - S) // B == blk  # its own block, bidirectional; never another block
            assert bool(m[q, kv]) == want, (q, kv)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_matches_sdpa_on_cpu():
    """The BlockMask (GPU path) and the bool mask (CPU path) give the same forward; flex has no CPU
    backward in torch 2.13, so gradients are covered by the SDPA path's tests."""
    from dflash_assets.drafter.loss import dflash_block_mask

    cfg = small_config()
    torch.manual_seed(0)
    m = DFlashDrafter(cfg).eval()
    head = random_head(cfg)
    b = random_batch(cfg, lengths=(20, 13), n_anchors=5)
    S = b.input_ids.shape[1]
    noise = torch.randint(0, cfg.vocab_size, (2, b.anchors.shape[1] * cfg.block_size))
    pos = torch.randint(0, S, (2, S + noise.shape[1]))
    with torch.no_grad():
        x = head.embed(noise)
        dense = m(x, b.hidden, pos, dflash_dense_mask(b.anchors, b.keep, S, cfg.block_size))
        flex = m(x, b.hidden, pos, dflash_block_mask(b.anchors, b.keep, S, cfg.block_size))
        torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)
        losses = [drafter_forward_loss(m, head, b, block_size=cfg.block_size, mask_token_id=cfg.mask_token_id,
                                       gamma=7.0, attention=a) for a in ("sdpa", "flex")]
    torch.testing.assert_close(losses[0].loss_sum, losses[1].loss_sum, rtol=1e-5, atol=1e-5)
    assert torch.equal(losses[0].correct_by_pos, losses[1].correct_by_pos)
    assert losses[0].weight_sum > 0


def test_training_layout_equals_per_block_inference():
    """Every block of the packed training forward equals a separate inference-style forward that
    sees only the context before its anchor (the same computation public DFlash decoding does)."""
    cfg = small_config()
    torch.manual_seed(1)
    m = DFlashDrafter(cfg).eval()
    head = random_head(cfg)
    b = random_batch(cfg, lengths=(20, 13), n_anchors=4, seed=2)
    B, S = cfg.block_size, b.input_ids.shape[1]
    from dflash_assets.drafter.loss import block_layout

    noise, block_pos = block_layout(b.input_ids, b.anchors, b.keep, B, cfg.mask_token_id)
    pos = torch.cat([torch.arange(S).expand(2, S), block_pos], 1)
    with torch.no_grad():
        packed = m(head.embed(noise), b.hidden, pos, dflash_dense_mask(b.anchors, b.keep, S, B))
        for i in range(2):
            for j in range(b.anchors.shape[1]):
                if not b.keep[i, j]:
                    continue
                a = int(b.anchors[i, j])
                x = head.embed(noise[i : i + 1, j * B : (j + 1) * B])
                one = m(x, b.hidden[i : i + 1, :a], torch.arange(a + B)[None])  # no mask: sees all it gets
                torch.testing.assert_close(packed[i, j * B : (j + 1) * B], one[0], rtol=1e-5, atol=1e-5)


def test_block_labels_decay_and_mask():
    ids = torch.arange(10)[None]
    lm = torch.ones(1, 10, dtype=torch.bool)
    lm[0, 4] = False
    labels, w = block_labels(ids, lm, torch.tensor([[1, 0]]), torch.tensor([[True, False]]), 4, gamma=7.0)
    assert labels[0, 0].tolist() == [2, 3, 4]
    k = torch.arange(1, 4).float()
    torch.testing.assert_close(w[0, 0], torch.exp(-(k - 1) / 7.0) * torch.tensor([1.0, 1.0, 0.0]))
    assert w[0, 1].sum() == 0  # padding block


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_analytic_block_mask_equals_create_block_mask():
    """The tile lists built from the anchors equal those create_block_mask finds by evaluating the
    mask, full tiles included, and flex with them equals SDPA with the dense mask."""
    import numpy as np
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from dflash_assets.drafter.loss import _dflash_mask_mod, dflash_block_mask

    B, S, N = 16, 512, 24
    rng = np.random.default_rng(0)
    anchors = torch.zeros(2, N, dtype=torch.long)
    keep = torch.zeros(2, N, dtype=torch.bool)
    for i, (n, start) in enumerate([(24, 150), (13, 20)]):  # row 0: every anchor >= 150 -> full tiles
        lm = np.zeros(S, bool)
        lm[start:470] = True
        a = sample_anchors(lm, B, n, rng)
        anchors[i, : len(a)], keep[i, : len(a)] = torch.from_numpy(a), True
    bm = dflash_block_mask(anchors, keep, S, B)
    ref = create_block_mask(_dflash_mask_mod(anchors, keep, S, B), B=2, H=None, Q_LEN=N * B, KV_LEN=S + N * B)

    def tiles(num, idx):
        return [[sorted(idx[i, 0, q, : num[i, 0, q]].tolist()) for q in range(num.shape[2])] for i in range(2)]

    assert tiles(bm.kv_num_blocks, bm.kv_indices) == tiles(ref.kv_num_blocks, ref.kv_indices)
    full = tiles(bm.full_kv_num_blocks, bm.full_kv_indices)
    assert full == tiles(ref.full_kv_num_blocks, ref.full_kv_indices) and any(full[0])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, N * B, 8, generator=g)
    k = torch.randn(2, 2, S + N * B, 8, generator=g)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q, k, k, attn_mask=dflash_dense_mask(anchors, keep, S, B), enable_gqa=True)
    torch.testing.assert_close(flex_attention(q, k, k, block_mask=bm, enable_gqa=True), dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 5, 1000])
def test_head_cross_entropy_matches_torch(chunk):
    g = torch.Generator().manual_seed(0)
    W = torch.randn(50, 16, generator=g)
    h = torch.randn(23, 16, generator=g, requires_grad=True)
    y = torch.randint(0, 50, (23,), generator=g)
    w = torch.rand(23, generator=g)
    loss, correct = head_cross_entropy(h, W, y, w, chunk=chunk)
    loss.backward()
    h2 = h.detach().clone().requires_grad_(True)
    logits = h2 @ W.T
    ref = (F.cross_entropy(logits, y, reduction="none") * w).sum()
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(h.grad, h2.grad)
    assert torch.equal(correct, logits.argmax(-1) == y)


