"""The DFlash training objective: block layout, attention masks, the frozen head's cross-entropy, one step.

Per sequence: blocks of [anchor token, MASK x (B-1)] at the anchors' positions;
a block sees its sequence's target context strictly before its anchor and itself
(dense mask for SDPA, a BlockMask for flex_attention), in either batch layout
(``data.Batch``: one padded row per sequence, or all blocks and contexts packed
in one row, where a block's context is its own sequence's stretch of the row); labels are the next
B-1 tokens weighted by exp(-(k-1)/gamma) (objective ``dflash``) or by their
expected contribution to the acceptance length (objective ``dpace``,
``dpace_weights``); the cross-entropy against the frozen ``lm_head`` is computed
chunk by chunk, never all logits at once. Reads and writes nothing. Imports only torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dflash_assets.drafter.data import Batch
from dflash_assets.drafter.model import SegmentedMask, TargetHead
from dflash_assets.torch_compile import block_mask_from_kv_blocks

__all__ = ["block_layout", "block_labels", "dpace_weights", "dflash_dense_mask", "dflash_segmented_mask",
           "dflash_block_mask", "head_cross_entropy", "HeadCrossEntropy", "head_cross_entropy_reweighted",
           "default_chunk_rows", "StepOutput", "drafter_forward_loss", "train_step"]


def block_layout(input_ids, anchors, keep, block_size: int, mask_token_id: int):
    """Block inputs: noise ids (b, N*B) = [anchor token, MASK x (B-1)] per block and positions (b, N*B)."""
    b, N = anchors.shape
    B = block_size
    offsets = torch.arange(B, device=anchors.device)
    positions = (anchors[:, :, None] + offsets).view(b, N * B)  # (b, N*B)
    noise = torch.full((b, N, B), mask_token_id, dtype=torch.long, device=anchors.device)
    first = torch.gather(input_ids, 1, anchors)  # (b, N)
    noise[:, :, 0] = torch.where(keep, first, torch.full_like(first, mask_token_id))
    return noise.view(b, N * B), positions


def block_labels(input_ids, loss_mask, anchors, keep, block_size: int, gamma: float):
    """Labels (b, N, B-1) = tokens anchor+k, k=1..B-1, and weights keep * loss_mask * exp(-(k-1)/gamma)."""
    b, N = anchors.shape
    S = input_ids.shape[1]
    k = torch.arange(1, block_size, device=anchors.device)
    idx = (anchors[:, :, None] + k).clamp(max=S - 1).view(b, -1)  # (b, N*(B-1))
    labels = torch.gather(input_ids, 1, idx).view(b, N, -1)
    valid = torch.gather(loss_mask, 1, idx).view(b, N, -1) & keep[:, :, None]
    decay = torch.exp(-(k - 1).float() / gamma)  # (B-1,)
    return labels, valid.float() * decay


def dpace_weights(p: torch.Tensor, valid: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """D-PACE position weights (rows, B-1), detached: each position's expected contribution to the acceptance length.

    p: the drafter's probability of each label (rows, B-1); valid: which positions carry a label. Smoothed
    q_k = (1 - alpha) * p_k + alpha; the prefix products P_k = q_1 ... q_k are the chance a draft survives to
    position k (the expected acceptance length is their sum), and position k's weight is the suffix sum
    P_k + ... + P_{B-1}, the derivative of that sum by log q_k. A position without a label is a no-op in the
    products (q = 1) and is left out of the sums (its weight is 0)."""
    p, valid = p.detach().float(), valid.bool()
    q = torch.where(valid, (1.0 - alpha) * p + alpha, torch.ones_like(p))
    survive = torch.cumprod(q, dim=-1) * valid  # (rows, B-1)
    return survive.flip(-1).cumsum(-1).flip(-1) * valid


def _context_range(anchors, keep, starts=None):
    """The context keys [lo, hi) each block sees, (b, N) each: its sample's tokens before its anchor (`starts`:
    where each block's sample begins among the context keys, packed layout; None: at 0). Empty where not kept."""
    lo = torch.zeros_like(anchors) if starts is None else starts
    zero = torch.zeros_like(anchors)
    return torch.where(keep, lo, zero), torch.where(keep, lo + anchors, zero)


def dflash_dense_mask(anchors, keep, S: int, block_size: int, starts=None) -> torch.Tensor:
    """Bool mask (b, 1, N*B, S+N*B): [context | blocks] keys visible to each block query (SDPA)."""
    b, N = anchors.shape
    B = block_size
    dev = anchors.device
    lo, hi = _context_range(anchors, keep, starts)
    q_blk = torch.arange(N * B, device=dev) // B  # (Q,)
    kv = torch.arange(S + N * B, device=dev)  # (KV,)
    ctx = (kv < S) & (kv >= lo[:, q_blk, None]) & (kv < hi[:, q_blk, None])  # (b, Q, KV): before the anchor
    own = (kv >= S) & ((kv - S).div(B, rounding_mode="floor") == q_blk[:, None])  # same block
    return (ctx | own[None])[:, None]


def dflash_segmented_mask(anchors, keep, block_sample, ctx_start, S: int, block_size: int,
                          tile: int = 128) -> SegmentedMask:
    """The visibility of `dflash_dense_mask` for a packed row (1, nb), in pieces for SDPA: runs of at most
    tile / B blocks of one sample, each seeing that sample's context up to its last anchor and its own blocks'
    keys. What SDPA computes then grows with the visible keys (as flex's tiles do), not with the square of the
    row (one dense mask over it), nor with every block's keys for every query (a padded row's dense mask)."""
    B, G = block_size, max(1, tile // block_size)
    runs, counts = torch.unique_consecutive(block_sample[0], return_counts=True)
    seen = torch.where(keep, anchors, torch.zeros_like(anchors))[0].tolist()
    pieces, first = [], 0
    for i, n in zip(runs.tolist(), counts.tolist()):
        c0 = int(ctx_start[i])
        for j in range(first, first + n, G):
            e = min(j + G, first + n)
            c = max(seen[j:e])  # context keys [c0, c0 + c) are seen by some block of the piece
            pieces.append((j * B, e * B, c0, c0 + c, dflash_dense_mask(anchors[:, j:e], keep[:, j:e], c, B)))
        first += n
    return SegmentedMask(S, pieces)


def _dflash_mask_mod(anchors, keep, S: int, block_size: int, starts=None):
    """mask_mod over [context (S) | blocks] keys. Only tensors are closed over (S and N as 0-d
    tensors), so a compiled graph is reused across steps instead of specializing on their values."""
    B = block_size
    S_t = torch.tensor(S, device=anchors.device)
    last = torch.tensor(anchors.shape[1] - 1, device=anchors.device)
    lo, hi = _context_range(anchors, keep, starts)

    def mask_mod(bi, h, q_idx, kv_idx):
        blk = torch.minimum(q_idx // B, last)
        ctx = (kv_idx < S_t) & (kv_idx >= lo[bi, blk]) & (kv_idx < hi[bi, blk])
        own = (kv_idx >= S_t) & ((kv_idx - S_t) // B == blk)
        return ctx | own

    return mask_mod


def dflash_block_mask(anchors, keep, S: int, block_size: int, tile: int = 128, starts=None):
    """The same visibility as `dflash_dense_mask`, as a flex_attention BlockMask (built once per step).

    When the layout is tile aligned (S and N*B multiples of the 128 tile, B dividing it) the tile
    lists are computed directly from each block's context range [lo, hi) (`_context_range`): for the
    G = tile/B blocks of a query tile, context tiles inside every range are full, the others that meet
    some range partial, plus the one diagonal tile holding those blocks' own keys. Otherwise
    `create_block_mask` evaluates the mask.
    """
    b, N = anchors.shape
    B, T = block_size, tile
    Q, KV = N * B, S + N * B
    mask_mod = _dflash_mask_mod(anchors, keep, S, B, starts)
    if S % T or Q % T or T % B:
        from torch.nn.attention.flex_attention import create_block_mask

        return create_block_mask(mask_mod, B=b, H=None, Q_LEN=Q, KV_LEN=KV, device=anchors.device)

    n_q, n_kv, G = Q // T, KV // T, T // B
    lo, hi = (x.view(b, n_q, G) for x in _context_range(anchors, keep, starts))
    k = keep.view(b, n_q, G)
    p1 = (torch.where(k, hi, torch.zeros_like(hi)).amax(-1) + T - 1) // T  # past the last tile any block sees
    p0 = torch.minimum(torch.where(k, lo, torch.full_like(lo, KV)).amin(-1) // T, p1)  # the first
    f0 = (torch.where(k, lo, torch.zeros_like(lo)).amax(-1) + T - 1) // T  # tiles [f0, f1) every block sees whole
    f1 = torch.where(k, hi, torch.full_like(hi, KV)).amin(-1) // T
    has_full = k.all(-1) & (f1 > f0)
    f0, f1 = torch.where(has_full, f0, p1), torch.where(has_full, f1, p1)
    n_left, n_right = f0 - p0, p1 - f1  # partial tiles: [p0, f0) and [f1, p1)
    n_part = n_left + n_right
    idx = torch.arange(n_kv, device=anchors.device)
    diag = (S // T + torch.arange(n_q, device=anchors.device))[None, :, None]  # own-block tile
    kv_indices = torch.where(idx < n_left[..., None], p0[..., None] + idx,
                             torch.where(idx < n_part[..., None], f1[..., None] + idx - n_left[..., None],
                                         torch.where(idx == n_part[..., None], diag, torch.zeros_like(idx))))
    full_indices = (f0[..., None] + idx).clamp(max=n_kv - 1)
    i32 = torch.int32
    return block_mask_from_kv_blocks(
        (n_part + 1)[:, None].to(i32), kv_indices[:, None].to(i32), (f1 - f0)[:, None].to(i32),
        full_indices[:, None].to(i32).contiguous(), BLOCK_SIZE=T, mask_mod=mask_mod, seq_lengths=(Q, KV))


# ----------------------------------------------------------------------------------------------
# Loss: the frozen lm_head and cross-entropy, chunked over rows, never all logits at once


def _ce_chunk(h, weight, labels, w, need_grad: bool):
    logits = (h.to(weight.dtype) @ weight.T).float()  # (c, V)
    lse = torch.logsumexp(logits, dim=-1)  # (c,)
    tgt = logits.gather(1, labels[:, None]).squeeze(1)
    ce = lse - tgt  # (c,)
    loss = (ce * w).sum()
    correct = logits.argmax(dim=-1) == labels
    grad = None
    if need_grad:  # d(sum w*ce)/dh = (softmax - onehot) * w @ W
        p = logits.sub_(lse[:, None]).exp_()
        p.scatter_add_(1, labels[:, None], -torch.ones_like(p[:, :1]))
        p.mul_(w[:, None])
        grad = (p.to(weight.dtype) @ weight).to(h.dtype)
    return loss, correct, grad, ce


_compiled_ce_chunk = None


class HeadCrossEntropy(torch.autograd.Function):
    """sum_i w_i * CE(h_i @ W^T, y_i) with a frozen W; the gradient w.r.t. h is made chunk by chunk
    in the forward pass, so no (rows x vocab) logits tensor outlives its chunk.

    With ``reweight``, w is not given but made from the rows' label probabilities once every chunk is done
    (w = reweight(p), detached): the chunks run unweighted, then the sum and the kept gradient are weighted."""

    @staticmethod
    def forward(ctx, h, weight, labels, w, chunk: int, compiled: bool, reweight=None):
        fn = _ce_chunk
        if compiled:
            global _compiled_ce_chunk
            if _compiled_ce_chunk is None:
                _compiled_ce_chunk = torch.compile(_ce_chunk, dynamic=True)
            fn = _compiled_ce_chunk
        need_grad = ctx.needs_input_grad[0]
        M = h.shape[0]
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        correct = torch.zeros(M, dtype=torch.bool, device=h.device)
        grad = torch.empty_like(h) if need_grad else None
        ce = torch.empty(M, dtype=torch.float32, device=h.device)
        if reweight is not None:
            w = torch.ones(M, dtype=torch.float32, device=h.device)
        for s in range(0, M, chunk):
            e = min(M, s + chunk)
            l, c, g, ce[s:e] = fn(h[s:e], weight, labels[s:e], w[s:e], need_grad)
            loss += l
            correct[s:e] = c
            if need_grad:
                grad[s:e] = g
        if reweight is not None:
            w = reweight(torch.exp(-ce)).float()  # (M,) from p = exp(-CE), detached
            loss = (ce * w).sum()
            if need_grad:
                grad.mul_(w[:, None].to(grad.dtype))
        else:
            w = w.detach().clone()  # returned: a new tensor, never the input itself
        ctx.save_for_backward(grad if need_grad else None)
        ctx.mark_non_differentiable(correct, w)
        return loss, correct, w

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct, _grad_w):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), None, None, None, None, None, None


def default_chunk_rows(vocab: int) -> int:
    return max(1, (1 << 28) // vocab)  # ~1 GiB of fp32 logits per chunk


def head_cross_entropy(h, weight, labels, w, chunk: int | None = None, compiled: bool = False):
    """(weighted CE sum, correct per row) for rows h (M, H) against the frozen head weight (V, H)."""
    chunk = chunk or default_chunk_rows(weight.shape[0])
    loss, correct, _ = HeadCrossEntropy.apply(h, weight, labels, w, chunk, compiled)
    return loss, correct


def head_cross_entropy_reweighted(h, weight, labels, reweight, chunk: int | None = None, compiled: bool = False):
    """(weighted CE sum, correct per row, the weights) where the weights are ``reweight(p)`` of the rows' label
    probabilities p (M,), as D-PACE makes them; one pass over the head, like `head_cross_entropy`."""
    chunk = chunk or default_chunk_rows(weight.shape[0])
    w = torch.empty(0, device=h.device)  # unused: reweight makes them
    return HeadCrossEntropy.apply(h, weight, labels, w, chunk, compiled, reweight)


def _dpace_reweight(sel: torch.Tensor, blocks: int, positions: int, alpha: float):
    """p of the selected rows (those with a label) -> their D-PACE weights, computed over whole blocks."""

    def reweight(p_sel: torch.Tensor) -> torch.Tensor:
        p = torch.zeros(blocks * positions, device=p_sel.device).index_copy_(0, sel, p_sel.float())
        valid = torch.zeros(blocks * positions, dtype=torch.bool, device=p_sel.device).index_fill_(0, sel, True)
        return dpace_weights(p.view(blocks, positions), valid.view(blocks, positions), alpha).view(-1).index_select(0, sel)

    return reweight


@dataclass
class StepOutput:
    loss_sum: torch.Tensor  # sum w*CE over this rank's rows (differentiable)
    weight_sum: torch.Tensor  # sum w over this rank's rows
    correct_by_pos: torch.Tensor  # (B-1,) correct predictions among rows with a label
    count_by_pos: torch.Tensor  # (B-1,)


def _step_inputs(batch: Batch, hidden, B: int, mask_token_id: int, gamma: float, attention: str):
    """What the drafter's forward takes, per layout: (labels (rows, B-1), weights, block ids, position ids of
    [context | blocks], mask, context features). Packed (`Batch.packed`): the samples' rows are read as one long
    row, each block's anchor shifted to its sample's place in it, and a block sees its own sample's context."""
    S = batch.input_ids.shape[1]
    anchors, keep = batch.anchors, batch.keep
    if not batch.packed:
        ids, lm, rows_at, starts, ctx_len = batch.input_ids, batch.loss_mask, anchors, None, S
        ctx_pos = torch.arange(S, device=anchors.device).expand(ids.shape[0], S)
    else:
        ids, lm = batch.input_ids.reshape(1, -1), batch.loss_mask.reshape(1, -1)
        rows_at = batch.block_sample * S + anchors  # (1, nb): the anchors in the samples' rows read as one
        starts = batch.ctx_start[batch.block_sample]  # (1, nb): where each block's sample begins in the context
        ctx_pos, ctx_len = batch.ctx_index % S, batch.ctx_index.shape[1]
    labels, w = block_labels(ids, lm, rows_at, keep, B, gamma)
    noise_ids, _ = block_layout(ids, rows_at, keep, B, mask_token_id)
    block_pos = (anchors[:, :, None] + torch.arange(B, device=anchors.device)).view(anchors.shape[0], -1)
    position_ids = torch.cat([ctx_pos, block_pos], dim=1)  # (b, S + N*B)
    if attention == "flex":
        mask = dflash_block_mask(anchors, keep, ctx_len, B, starts=starts)
    elif batch.packed:  # SDPA in pieces: one dense mask over the packed row would cost the square of the row
        mask = dflash_segmented_mask(anchors, keep, batch.block_sample, batch.ctx_start, ctx_len, B)
    else:
        mask = dflash_dense_mask(anchors, keep, ctx_len, B)
    if batch.packed and tuple(hidden.shape[:2]) != (1, ctx_len):
        hidden = batch.pack_context(hidden)  # per-sample rows (online features) -> the packed context
    return labels, w, noise_ids, position_ids, mask, hidden


def drafter_forward_loss(drafter, head: TargetHead, batch: Batch, *, block_size: int, mask_token_id: int,
                         gamma: float, attention: str = "sdpa", hidden=None, compiled_loss: bool = False,
                         objective: str = "dflash", dpace_alpha: float = 0.5) -> StepOutput:
    """One training forward on a device batch: blocks, mask, drafter, chunked head CE (weights by `objective`).

    `hidden`: the context features, per-sample rows (b, S, n*H) or already in the batch's layout (default
    `batch.hidden`). Either layout of a batch (`Batch`) gives the same loss, block by block."""
    B = block_size
    hidden = batch.hidden if hidden is None else hidden
    b, N = batch.anchors.shape
    # labels first: selecting the rows that carry one syncs with the host, cheapest before the forward
    labels, w, noise_ids, position_ids, mask, hidden = _step_inputs(batch, hidden, B, mask_token_id, gamma, attention)
    labels, w = labels.reshape(-1), w.reshape(-1)  # (b*N*(B-1),)
    sel = torch.nonzero(w > 0).squeeze(1)
    k = torch.arange(B - 1, device=w.device).repeat(b * N).index_select(0, sel)  # block position - 1
    x = head.embed(noise_ids)  # (b, N*B, H)
    out = drafter(x, hidden, position_ids, mask)  # (b, N*B, H)
    rows = out.view(b, N, B, -1)[:, :, 1:].reshape(-1, out.shape[-1])  # (b*N*(B-1), H): predictions k=1..B-1
    if objective == "dpace":
        loss_sum, correct, w_sel = head_cross_entropy_reweighted(
            rows.index_select(0, sel), head.lm_head.weight, labels.index_select(0, sel),
            _dpace_reweight(sel, b * N, B - 1, dpace_alpha), compiled=compiled_loss)
        w = w_sel  # the weights the loss is normalized by
    elif objective == "dflash":
        loss_sum, correct = head_cross_entropy(rows.index_select(0, sel), head.lm_head.weight,
                                               labels.index_select(0, sel), w.index_select(0, sel),
                                               compiled=compiled_loss)
    else:
        raise ValueError(f"unknown objective {objective!r}")
    correct_by_pos = torch.zeros(B - 1, device=w.device).index_add_(0, k, correct.float())
    count_by_pos = torch.zeros(B - 1, device=w.device).index_add_(0, k, torch.ones_like(k, dtype=torch.float))
    return StepOutput(loss_sum, w.sum(), correct_by_pos, count_by_pos)


def train_step(model, head: TargetHead, optimizer, batch: Batch, hidden, *, block_size: int, mask_token_id: int,
               gamma: float, attention: str, grad_clip: float, compiled_loss: bool = False, world: int = 1,
               objective: str = "dflash", dpace_alpha: float = 0.5):
    """Forward, backward (loss normalized over the global batch), clip, AdamW step.

    Returns (stats, w_total): stats = [loss_sum, correct_by_pos (B-1), count_by_pos (B-1)] of this rank,
    w_total = the global sum of loss weights (the step's loss is all-reduced loss_sum / w_total)."""
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=hidden.is_cuda):
        so = drafter_forward_loss(model, head, batch, block_size=block_size, mask_token_id=mask_token_id,
                                  gamma=gamma, attention=attention, hidden=hidden, compiled_loss=compiled_loss,
                                  objective=objective, dpace_alpha=dpace_alpha)
    w_total = so.weight_sum.detach().float().clone()
    if world > 1:
        dist.all_reduce(w_total)
    loss = so.loss_sum / w_total.clamp_min(1e-6)
    (loss * world).backward()  # DDP averages gradients over ranks: this makes it the global mean
    params = [p for g in optimizer.param_groups for p in g["params"]]
    torch.nn.utils.clip_grad_norm_(params, grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    stats = torch.cat([so.loss_sum.detach().float().view(1), so.correct_by_pos, so.count_by_pos])
    return stats, w_total

