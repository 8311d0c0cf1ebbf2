"""The DFlash training objective: block layout, attention masks, the frozen head's cross-entropy, one step.

Per sequence: blocks of [anchor token, MASK x (B-1)] at the anchors' positions;
a block sees the target context strictly before its anchor and itself
(dense mask for SDPA, a BlockMask for flex_attention); labels are the next
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
from dflash_assets.drafter.model import TargetHead, create_block_mask

__all__ = ["block_layout", "block_labels", "dpace_weights", "dflash_dense_mask", "dflash_block_mask", "head_cross_entropy",
           "HeadCrossEntropy", "head_cross_entropy_reweighted", "default_chunk_rows", "StepOutput", "drafter_forward_loss", "train_step"]


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


def dflash_dense_mask(anchors, keep, S: int, block_size: int) -> torch.Tensor:
    """Bool mask (b, 1, N*B, S+N*B): [context | blocks] keys visible to each block query (SDPA)."""
    b, N = anchors.shape
    B = block_size
    dev = anchors.device
    q_blk = torch.arange(N * B, device=dev) // B  # (Q,)
    kv = torch.arange(S + N * B, device=dev)  # (KV,)
    anchor_q = anchors[:, q_blk]  # (b, Q)
    keep_q = keep[:, q_blk]  # (b, Q)
    ctx = (kv[None, None, :] < anchor_q[:, :, None]) & (kv < S) & keep_q[:, :, None]  # before anchor
    own = (kv >= S) & ((kv - S).div(B, rounding_mode="floor") == q_blk[:, None])  # same block
    return (ctx | own[None])[:, None]


def _dflash_mask_mod(anchors, keep, S: int, block_size: int):
    """mask_mod over [context (S) | blocks] keys. Only tensors are closed over (S and N as 0-d
    tensors), so a compiled graph is reused across steps instead of specializing on their values."""
    B = block_size
    S_t = torch.tensor(S, device=anchors.device)
    last = torch.tensor(anchors.shape[1] - 1, device=anchors.device)

    def mask_mod(bi, h, q_idx, kv_idx):
        blk = torch.minimum(q_idx // B, last)
        ctx = (kv_idx < S_t) & (kv_idx < anchors[bi, blk]) & keep[bi, blk]
        own = (kv_idx >= S_t) & ((kv_idx - S_t) // B == blk)
        return ctx | own

    return mask_mod


def dflash_block_mask(anchors, keep, S: int, block_size: int, tile: int = 128):
    """The same visibility as `dflash_dense_mask`, as a flex_attention BlockMask (built once per step).

    When the layout is tile aligned (S and N*B multiples of the 128 tile, B dividing it) the tile
    lists are computed directly from the anchors: for the G = tile/B blocks of a query tile,
    context tiles below min(anchor) are full, those below max(anchor) partial, plus the one
    diagonal tile holding those blocks' own keys. Otherwise `create_block_mask` evaluates the mask.
    """
    b, N = anchors.shape
    B, T = block_size, tile
    Q, KV = N * B, S + N * B
    mask_mod = _dflash_mask_mod(anchors, keep, S, B)
    if S % T or Q % T or T % B:
        return create_block_mask(mask_mod, B=b, H=None, Q_LEN=Q, KV_LEN=KV, device=anchors.device)
    from torch.nn.attention.flex_attention import BlockMask

    n_q, n_kv, G = Q // T, KV // T, T // B
    a = anchors.view(b, n_q, G)
    k = keep.view(b, n_q, G)
    a_min = torch.where(k, a, torch.full_like(a, KV)).amin(-1)  # (b, n_q)
    a_max = torch.where(k, a, torch.zeros_like(a)).amax(-1)
    n_full = torch.where(k.all(-1), a_min // T, torch.zeros_like(a_min))  # tiles every query sees fully
    n_part = (a_max + T - 1) // T - n_full  # tiles some query sees in part
    idx = torch.arange(n_kv, device=anchors.device)
    diag = (S // T + torch.arange(n_q, device=anchors.device))[None, :, None]  # own-block tile
    kv_indices = torch.where(idx < n_part[..., None], n_full[..., None] + idx,
                             torch.where(idx == n_part[..., None], diag, torch.zeros_like(idx)))
    full_indices = idx.expand(b, n_q, n_kv)
    i32 = torch.int32
    return BlockMask.from_kv_blocks(
        (n_part + 1)[:, None].to(i32), kv_indices[:, None].to(i32), n_full[:, None].to(i32),
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


def drafter_forward_loss(drafter, head: TargetHead, batch: Batch, *, block_size: int, mask_token_id: int,
                         gamma: float, attention: str = "sdpa", hidden=None, compiled_loss: bool = False,
                         objective: str = "dflash", dpace_alpha: float = 0.5) -> StepOutput:
    """One training forward on a device batch: blocks, mask, drafter, chunked head CE (weights by `objective`)."""
    B = block_size
    hidden = batch.hidden if hidden is None else hidden  # (b, S, n*H)
    b, S = batch.input_ids.shape
    N = batch.anchors.shape[1]
    # labels first: selecting the rows that carry one syncs with the host, cheapest before the forward
    labels, w = block_labels(batch.input_ids, batch.loss_mask, batch.anchors, batch.keep, B, gamma)
    labels, w = labels.reshape(-1), w.reshape(-1)  # (b*N*(B-1),)
    sel = torch.nonzero(w > 0).squeeze(1)
    k = torch.arange(B - 1, device=w.device).repeat(b * N).index_select(0, sel)  # block position - 1
    noise_ids, block_pos = block_layout(batch.input_ids, batch.anchors, batch.keep, B, mask_token_id)
    ctx_pos = torch.arange(S, device=block_pos.device).expand(b, S)
    position_ids = torch.cat([ctx_pos, block_pos], dim=1)  # (b, S + N*B)
    if attention == "flex":
        mask = dflash_block_mask(batch.anchors, batch.keep, S, B)
    else:
        mask = dflash_dense_mask(batch.anchors, batch.keep, S, B)
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

