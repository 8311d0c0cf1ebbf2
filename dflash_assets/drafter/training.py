"""Train a DFlash drafter on the hidden-state cache (or online from the target), resumable, DDP.

Reads: hidden-state cache files (safetensors per partition: `hidden` [T, n_layers*H],
`input_ids` int32, `loss_mask` uint8, `cu_seqlens` int64) or, in online mode, tokenized samples
(Parquet with `input_ids`/`loss_mask` list columns, or safetensors with `input_ids`, `loss_mask`,
`cu_seqlens`) plus the target model directory (its config, `embed_tokens` and `lm_head`; in online
mode the whole target, cut after the last captured layer).
Writes (under out_dir): `state/step-NNNNNNNN/` training state for resume (drafter.safetensors,
optimizer.safetensors, history.safetensors, trainer.json; no pickle), `state/latest`, and at the
end `drafter/` (model.safetensors + config.json, the public DFlash layout). Every write is
atomic (temp dir + rename).

One training step (per sequence): pick random anchors where loss_mask = 1 and position <=
len - B (at most `max_anchors`); block j = [token at anchor_j, MASK x (B-1)] at positions
anchor_j .. anchor_j+B-1; a block sees the target context strictly before its anchor, itself
bidirectionally, and no other block; label k (k >= 1) is token anchor_j + k, masked by loss_mask,
weighted exp(-(k-1)/gamma). The loss is sum(w * CE) / sum(w) over the global batch (all ranks),
so N processes with batch b train the same run as 1 process with batch N*b.

Multi-GPU: `python -m torch.distributed.run --nproc-per-node N -m dflash_assets.drafter.training
--recipe recipe.json --data f1.safetensors ... --target DIR --out DIR`.

Imports only torch, safetensors and numpy at module level (pyarrow, transformers lazily).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import queue
import random
import shutil
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from dflash_assets.target.conventions import mask_token_id_in_dir
from dflash_assets.target.layer_capture import LayerCapture
from dflash_assets.drafter.model import (
    DFlashDrafter,
    DrafterConfig,
    TargetHead,
    _atomic_dir,
    _swap_into_place,
    create_block_mask,
    drafter_state_dict,
    load_target_config,
    loss_gamma,
    save_drafter,
)

# ----------------------------------------------------------------------------------------------
# Recipe and result


@dataclass(frozen=True)
class DrafterRecipe:
    """Everything that defines a drafter training run (a `drafter_recipes` partition)."""

    name: str
    version: str = "1"
    block_size: int = 16
    num_layers: int = 5
    epochs: int = 6
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    max_length: int = 3072
    max_anchors: int = 512
    gamma: float | None = None  # None: derived from block_size (7 for 16, 5 for 10, 4 for 8)
    batch_size: int = 1  # sequences per process per step
    seed: int = 0
    partitions: tuple[str, ...] = ()  # data selection: partition keys of the cache / samples
    online: bool = False  # compute target hidden states during training instead of the cache
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    target_layer_ids: tuple[int, ...] | None = None  # None: cache metadata, else the default rule
    mask_token_id: int | None = None  # None: the target tokenizer's <|MASK|> / known family id
    save_every: int = 500  # steps between resumable training states
    attention: str = "auto"  # auto (flex on GPU, sdpa on CPU) | flex | sdpa
    compile: bool = True  # GPU only: torch.compile the decoder layers and the loss chunks
    checkpoint_dtype: str = "bfloat16"  # dtype of the published drafter weights

    @property
    def loss_gamma(self) -> float:
        return self.gamma if self.gamma is not None else loss_gamma(self.block_size)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DrafterRecipe":
        d = dict(d)
        for k in ("partitions", "target_layer_ids"):
            if d.get(k) is not None:
                d[k] = tuple(d[k])
        return cls(**d)

    def fingerprint(self) -> str:
        """Hash of the fields that change the run (not save_every / compile / attention)."""
        d = {k: v for k, v in self.to_dict().items() if k not in ("save_every", "compile", "attention")}
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=list).encode()).hexdigest()[:16]


@dataclass
class TrainResult:
    checkpoint_dir: Path | None  # the published drafter (None if stopped before the end)
    state_dir: Path | None  # the last resumable training state
    steps: int
    total_steps: int
    losses: list[float]  # global loss of every step from step 1
    tokens_per_s: float  # sequence tokens (all ranks) per second, this invocation
    accuracy_by_position: list[float]  # k = 1..B-1, over the last (possibly partial) epoch
    resumed_from_step: int | None
    wall_s: float
    num_sequences: int
    world_size: int
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.steps >= self.total_steps

    def metrics(self) -> dict[str, Any]:
        tail = self.losses[-50:]
        return {
            "steps": self.steps,
            "total_steps": self.total_steps,
            "final_loss": float(np.mean(tail)) if tail else float("nan"),
            "first_loss": self.losses[0] if self.losses else float("nan"),
            "tokens_per_s": self.tokens_per_s,
            "accuracy_by_position": self.accuracy_by_position,
            "mean_accuracy": float(np.mean(self.accuracy_by_position)) if self.accuracy_by_position else 0.0,
            "resumed_from_step": self.resumed_from_step,
            "wall_s": self.wall_s,
            "num_sequences": self.num_sequences,
            "world_size": self.world_size,
        }


# ----------------------------------------------------------------------------------------------
# Data: the hidden-state cache (offline) and tokenized samples (online)


@dataclass
class Sample:
    input_ids: np.ndarray  # (T,) int64
    loss_mask: np.ndarray  # (T,) bool
    hidden: torch.Tensor | None  # (T, n*H) target features; None in online mode


def _parse_layer_ids(meta: dict[str, str]) -> list[int] | None:
    for key in ("target_layer_ids", "layer_ids"):
        if key in meta:
            raw = meta[key].strip()
            try:
                return [int(x) for x in json.loads(raw)]
            except (ValueError, TypeError):
                return [int(x) for x in raw.strip("[]").split(",") if x.strip()]
    return None


class _HandleCache:
    """A few safe_open handles kept open (a corpus has ~1000 partition files)."""

    def __init__(self, size: int = 16):
        self.size = size
        self.handles: OrderedDict[str, Any] = OrderedDict()
        self.lock = threading.Lock()

    def get(self, path: str):
        from safetensors import safe_open

        with self.lock:
            if path in self.handles:
                self.handles.move_to_end(path)
                return self.handles[path]
            h = safe_open(path, framework="pt")
            self.handles[path] = h
            if len(self.handles) > self.size:
                self.handles.popitem(last=False)
            return h


class SequenceFiles:
    """Sequences of safetensors partition files in the cache layout (`cu_seqlens` + per-token tensors).

    With `need_hidden` the files are the hidden-state cache; without, only `input_ids`/`loss_mask`
    are read (tokenized samples in the same layout). It reads the same files as
    `hidden_states.format.HiddenStateCacheReader`, by slices of one handle per file; the two readers are
    still separate (one of them should go, together with a bounded local cache of parts).
    """

    def __init__(self, files: Sequence[str | Path], max_length: int, block_size: int, need_hidden: bool = True):
        self.files = [str(f) for f in files]
        self.max_length = max_length
        self.need_hidden = need_hidden
        self._h = _HandleCache()
        self.index: list[tuple[int, int, int]] = []  # (file, start, length)
        self.metadata: dict[str, str] = {}
        for fi, path in enumerate(self.files):
            h = self._h.get(path)
            self.metadata = self.metadata or (h.metadata() or {})
            cu = h.get_tensor("cu_seqlens").tolist()
            lm = h.get_tensor("loss_mask").numpy()
            for s, e in zip(cu[:-1], cu[1:]):
                n = min(e - s, max_length)
                if _num_anchor_positions(lm[s : s + n], block_size) > 0:
                    self.index.append((fi, s, n))
        self.layer_ids = _parse_layer_ids(self.metadata)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> Sample:
        fi, s, n = self.index[i]
        h = self._h.get(self.files[fi])
        ids = h.get_slice("input_ids")[s : s + n].numpy().astype(np.int64)
        lm = h.get_slice("loss_mask")[s : s + n].numpy().astype(bool)
        hidden = h.get_slice("hidden")[s : s + n] if self.need_hidden else None
        return Sample(ids, lm, hidden)


class ParquetSamples:
    """Tokenized samples (online mode) from Parquet files with `input_ids` and `loss_mask` lists."""

    def __init__(self, files: Sequence[str | Path], max_length: int, block_size: int):
        import pyarrow.parquet as pq

        self.rows: list[tuple[np.ndarray, np.ndarray]] = []
        for path in files:
            t = pq.read_table(str(path), columns=["input_ids", "loss_mask"])
            for ids, lm in zip(t.column("input_ids").to_pylist(), t.column("loss_mask").to_pylist()):
                ids = np.asarray(ids[:max_length], dtype=np.int64)
                lm = np.asarray(lm[:max_length], dtype=bool)
                if _num_anchor_positions(lm, block_size) > 0:
                    self.rows.append((ids, lm))
        self.layer_ids = None

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Sample:
        ids, lm = self.rows[i]
        return Sample(ids, lm, None)


def open_training_data(files: Sequence[str | Path], recipe: DrafterRecipe):
    files = [str(f) for f in files]
    if recipe.online and all(f.endswith(".parquet") for f in files):
        return ParquetSamples(files, recipe.max_length, recipe.block_size)
    return SequenceFiles(files, recipe.max_length, recipe.block_size, need_hidden=not recipe.online)


# ----------------------------------------------------------------------------------------------
# Anchors, blocks, masks


def _num_anchor_positions(loss_mask: np.ndarray, block_size: int) -> int:
    return int(loss_mask[: max(len(loss_mask) - block_size + 1, 0)].sum())


def sample_anchors(loss_mask: np.ndarray, block_size: int, max_anchors: int, rng: np.random.Generator) -> np.ndarray:
    """Sorted random anchors: loss_mask = 1 and position <= len - block_size, at most max_anchors."""
    valid = np.flatnonzero(loss_mask[: max(len(loss_mask) - block_size + 1, 0)])
    n = min(max_anchors, len(valid))
    return np.sort(rng.choice(valid, size=n, replace=False))


def anchor_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """Anchors depend only on (seed, epoch, sample): same run whatever the rank layout or resume."""
    return np.random.default_rng([seed, epoch, index])


@dataclass
class Batch:
    input_ids: torch.Tensor  # (b, S) int64
    loss_mask: torch.Tensor  # (b, S) bool
    hidden: torch.Tensor | None  # (b, S, n*H)
    anchors: torch.Tensor  # (b, N) int64, sorted per row; 0 where not kept
    keep: torch.Tensor  # (b, N) bool, False for padding blocks
    num_tokens: int  # real sequence tokens in the batch

    def to(self, device, non_blocking: bool = True) -> "Batch":
        mv = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return Batch(mv(self.input_ids), mv(self.loss_mask), mv(self.hidden), mv(self.anchors), mv(self.keep), self.num_tokens)


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def collate(samples: list[Sample], anchors: list[np.ndarray], seq_multiple: int = 1,
            anchor_multiple: int = 1, pin: bool = False) -> Batch:
    """Pad sequences (right) and anchor lists into a batch; padding never enters the loss."""
    b = len(samples)
    S = _round_up(max(len(s.input_ids) for s in samples), seq_multiple)
    N = _round_up(max(len(a) for a in anchors), anchor_multiple)
    ids = torch.zeros(b, S, dtype=torch.long)
    lm = torch.zeros(b, S, dtype=torch.bool)
    anc = torch.zeros(b, N, dtype=torch.long)
    keep = torch.zeros(b, N, dtype=torch.bool)
    hidden = None
    if samples[0].hidden is not None:
        h0 = samples[0].hidden
        hidden = torch.zeros(b, S, h0.shape[-1], dtype=h0.dtype, pin_memory=pin)
    for i, (s, a) in enumerate(zip(samples, anchors)):
        T = len(s.input_ids)
        ids[i, :T] = torch.from_numpy(s.input_ids)
        lm[i, :T] = torch.from_numpy(s.loss_mask)
        anc[i, : len(a)] = torch.from_numpy(a.astype(np.int64))
        keep[i, : len(a)] = True
        if hidden is not None:
            hidden[i, :T] = s.hidden
    if pin:
        ids, lm, anc, keep = ids.pin_memory(), lm.pin_memory(), anc.pin_memory(), keep.pin_memory()
    return Batch(ids, lm, hidden, anc, keep, sum(len(s.input_ids) for s in samples))


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
    loss = ((lse - tgt) * w).sum()
    correct = logits.argmax(dim=-1) == labels
    grad = None
    if need_grad:  # d(sum w*ce)/dh = (softmax - onehot) * w @ W
        p = logits.sub_(lse[:, None]).exp_()
        p.scatter_add_(1, labels[:, None], -torch.ones_like(p[:, :1]))
        p.mul_(w[:, None])
        grad = (p.to(weight.dtype) @ weight).to(h.dtype)
    return loss, correct, grad


_compiled_ce_chunk = None


class HeadCrossEntropy(torch.autograd.Function):
    """sum_i w_i * CE(h_i @ W^T, y_i) with a frozen W; the gradient w.r.t. h is made chunk by chunk
    in the forward pass, so no (rows x vocab) logits tensor outlives its chunk."""

    @staticmethod
    def forward(ctx, h, weight, labels, w, chunk: int, compiled: bool):
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
        for s in range(0, M, chunk):
            e = min(M, s + chunk)
            l, c, g = fn(h[s:e], weight, labels[s:e], w[s:e], need_grad)
            loss += l
            correct[s:e] = c
            if need_grad:
                grad[s:e] = g
        ctx.save_for_backward(grad if need_grad else None)
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss, _grad_correct):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), None, None, None, None, None


def default_chunk_rows(vocab: int) -> int:
    return max(1, (1 << 28) // vocab)  # ~1 GiB of fp32 logits per chunk


def head_cross_entropy(h, weight, labels, w, chunk: int | None = None, compiled: bool = False):
    """(weighted CE sum, correct per row) for rows h (M, H) against the frozen head weight (V, H)."""
    chunk = chunk or default_chunk_rows(weight.shape[0])
    return HeadCrossEntropy.apply(h, weight, labels, w, chunk, compiled)


@dataclass
class StepOutput:
    loss_sum: torch.Tensor  # sum w*CE over this rank's rows (differentiable)
    weight_sum: torch.Tensor  # sum w over this rank's rows
    correct_by_pos: torch.Tensor  # (B-1,) correct predictions among rows with a label
    count_by_pos: torch.Tensor  # (B-1,)


def drafter_forward_loss(drafter, head: TargetHead, batch: Batch, *, block_size: int, mask_token_id: int,
                         gamma: float, attention: str = "sdpa", hidden=None, compiled_loss: bool = False) -> StepOutput:
    """One training forward on a device batch: blocks, mask, drafter, chunked head CE."""
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
    loss_sum, correct = head_cross_entropy(rows.index_select(0, sel), head.lm_head.weight, labels.index_select(0, sel),
                                           w.index_select(0, sel), compiled=compiled_loss)
    correct_by_pos = torch.zeros(B - 1, device=w.device).index_add_(0, k, correct.float())
    count_by_pos = torch.zeros(B - 1, device=w.device).index_add_(0, k, torch.ones_like(k, dtype=torch.float))
    return StepOutput(loss_sum, w.sum(), correct_by_pos, count_by_pos)


def train_step(model, head: TargetHead, optimizer, batch: Batch, hidden, *, block_size: int, mask_token_id: int,
               gamma: float, attention: str, grad_clip: float, compiled_loss: bool = False, world: int = 1):
    """Forward, backward (loss normalized over the global batch), clip, AdamW step.

    Returns (stats, w_total): stats = [loss_sum, correct_by_pos (B-1), count_by_pos (B-1)] of this rank,
    w_total = the global sum of loss weights (the step's loss is all-reduced loss_sum / w_total)."""
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=hidden.is_cuda):
        so = drafter_forward_loss(model, head, batch, block_size=block_size, mask_token_id=mask_token_id,
                                  gamma=gamma, attention=attention, hidden=hidden, compiled_loss=compiled_loss)
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


# ----------------------------------------------------------------------------------------------
# Online mode: the target's hidden states of the chosen layers, computed on the fly


class TargetFeatures:
    """The target cut after its last needed layer, with hooks: input_ids (b, T) -> (b, T, n*H).

    The same `LayerCapture` as the hidden-state cache, so online and offline features are identical."""

    def __init__(self, target_dir: str | Path, layer_ids: Sequence[int], device, dtype):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype)
        self.capture = LayerCapture(model, layer_ids, cut=True).__enter__()  # held for the target's lifetime
        self.model = self.capture.text_model.to(device).eval().requires_grad_(False)

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        # right padding never changes earlier positions of a causal model
        self.model(input_ids=input_ids, use_cache=False)
        return self.capture.features()


# ----------------------------------------------------------------------------------------------
# Batches in step order (a background thread reads ahead)


class BatchPlan:
    """Which samples each rank sees at each step: a pure function of (seed, epoch, step, rank)."""

    def __init__(self, n: int, recipe: DrafterRecipe, world: int, rank: int):
        self.n, self.recipe, self.world, self.rank = n, recipe, world, rank
        self.global_batch = recipe.batch_size * world
        self.steps_per_epoch = math.ceil(n / self.global_batch)
        self.total_steps = self.steps_per_epoch * recipe.epochs
        self._perm: tuple[int, np.ndarray] | None = None

    def indices(self, step: int) -> tuple[int, list[int]]:
        epoch, i = divmod(step, self.steps_per_epoch)
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng([self.recipe.seed, epoch, 7]).permutation(self.n))
        perm = self._perm[1]
        start = i * self.global_batch + self.rank * self.recipe.batch_size
        # the last global batch of an epoch wraps around so that every rank always has a full batch
        return epoch, [int(perm[(start + j) % self.n]) for j in range(self.recipe.batch_size)]


class BatchLoader:
    def __init__(self, data, plan: BatchPlan, start_step: int, stop_step: int, cuda: bool, depth: int = 2):
        self.data, self.plan, self.cuda = data, plan, cuda
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.thread = threading.Thread(target=self._run, args=(start_step, stop_step), daemon=True)
        self.thread.start()

    def _make(self, step: int) -> Batch:
        r = self.plan.recipe
        epoch, idx = self.plan.indices(step)
        samples = [self.data[i] for i in idx]
        anchors = [sample_anchors(s.loss_mask, r.block_size, r.max_anchors, anchor_rng(r.seed, epoch, i))
                   for s, i in zip(samples, idx)]
        # flex tiles are 128 wide: pad S and N*B to multiples of 128 on GPU
        return collate(samples, anchors, seq_multiple=128 if self.cuda else 1,
                       anchor_multiple=max(1, 128 // r.block_size) if self.cuda else 1, pin=self.cuda)

    def _run(self, start: int, stop: int):
        try:
            for step in range(start, stop):
                self.q.put((step, self._make(step)))
        except BaseException as e:  # surface loader errors in the training thread
            self.q.put((None, e))

    def next(self) -> tuple[int, Batch]:
        step, batch = self.q.get()
        if step is None:
            raise batch
        return step, batch


# ----------------------------------------------------------------------------------------------
# Training state: safetensors + json, atomic, no pickle


def _rng_state() -> dict[str, Any]:
    py = random.getstate()
    npst = np.random.get_state()
    st = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [npst[0], npst[1].tolist(), int(npst[2]), int(npst[3]), float(npst[4])],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state().tolist()
    return st


def _set_rng_state(st: dict[str, Any]):
    random.setstate((st["python"][0], tuple(st["python"][1]), st["python"][2]))
    n = st["numpy"]
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(torch.tensor(st["torch"], dtype=torch.uint8))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(st["cuda"], dtype=torch.uint8))


def save_training_state(state_root: Path, step: int, drafter, optimizer, scheduler, trainer: dict[str, Any],
                        history: dict[str, torch.Tensor], keep: int = 2) -> Path:
    """Write state/step-NNNNNNNN atomically, point state/latest at it, prune older states."""
    from safetensors.torch import save_file

    dest = state_root / f"step-{step:08d}"
    tmp = _atomic_dir(dest)
    try:
        save_file({k: v.float().cpu().contiguous() for k, v in drafter_state_dict(drafter).items()},
                  str(tmp / "drafter.safetensors"))
        names = {id(p): n for n, p in _unwrap(drafter).named_parameters()}
        opt = optimizer.state_dict()
        params = [p for g in optimizer.param_groups for p in g["params"]]
        tensors = {}
        for idx, st in opt["state"].items():
            name = names[id(params[idx])]
            for k, v in st.items():
                tensors[f"{name}::{k}"] = torch.as_tensor(v).detach().cpu().contiguous()
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        save_file({k: v.contiguous() for k, v in history.items()}, str(tmp / "history.safetensors"))
        groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
                  for g in opt["param_groups"]]
        doc = {**trainer, "step": step, "optimizer_param_groups": groups,
               "scheduler": scheduler.state_dict(), "rng": _rng_state()}
        (tmp / "trainer.json").write_text(json.dumps(doc))
        _swap_into_place(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    latest_tmp = state_root / f".latest.tmp-{os.getpid()}"
    latest_tmp.write_text(dest.name)
    os.replace(latest_tmp, state_root / "latest")
    for old in sorted(state_root.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return dest


def latest_state_dir(state_root: Path) -> Path | None:
    p = state_root / "latest"
    if p.exists() and (state_root / p.read_text().strip() / "trainer.json").exists():
        return state_root / p.read_text().strip()
    done = [d for d in sorted(state_root.glob("step-*")) if (d / "trainer.json").exists()]
    return done[-1] if done else None


def load_training_state(state_dir: Path, drafter, optimizer, scheduler, device) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    doc = json.loads((state_dir / "trainer.json").read_text())
    _unwrap(drafter).load_state_dict(load_file(str(state_dir / "drafter.safetensors"), device=str(device)), strict=True)
    flat = load_file(str(state_dir / "optimizer.safetensors"), device="cpu")
    index = {n: i for i, (n, _) in enumerate(_unwrap(drafter).named_parameters())}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in flat.items():
        name, k = key.split("::")
        state.setdefault(index[name], {})[k] = t
    groups = [{**g, "params": list(range(len(index)))} for g in doc["optimizer_param_groups"]]
    for g in groups:
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    scheduler.load_state_dict(doc["scheduler"])
    _set_rng_state(doc["rng"])
    history = load_file(str(state_dir / "history.safetensors"))
    return doc, history


def _unwrap(m):
    m = getattr(m, "module", m)
    return getattr(m, "_orig_mod", m)


# ----------------------------------------------------------------------------------------------
# The training loop


def lr_lambda(total_steps: int, warmup_ratio: float) -> Callable[[int], float]:
    warmup = max(1, math.ceil(warmup_ratio * total_steps))

    def f(step: int) -> float:  # linear warmup, then cosine to 0
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(t, 1.0)))

    return f


def _allow_recompiles(limit: int = 64):
    """Sequence length and anchor count vary per batch (padded to multiples of 128 / 8): let dynamo
    recompile (it turns those dims dynamic after the first change) instead of falling back to eager."""
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name) and getattr(cfg, name) < limit:
            setattr(cfg, name, limit)


def _dist_info() -> tuple[int, int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0))
    return 0, 1, 0


def train_drafter(
    recipe: DrafterRecipe,
    data_files: Sequence[str | Path],
    target_dir: str | Path,
    out_dir: str | Path,
    resume: bool = True,
    log: Callable[[dict[str, Any]], None] | None = None,
    *,
    device: str | torch.device | None = None,
    max_steps: int | None = None,
) -> TrainResult:
    """Train (or continue training) a drafter; see the module docstring for what is read and written.

    data_files: hidden-state cache partitions (offline) or tokenized-sample files (recipe.online).
    max_steps: stop after this global step (a resumable state is saved there); for smoke runs/tests.
    log: called on every rank-0 step with {"step", "loss", "lr", "tokens_per_s", "acc_by_pos", ...}.
    """
    t_start = time.perf_counter()
    rank, world, local_rank = _dist_info()
    if device is None:
        device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    out = Path(out_dir)
    state_root = out / "state"
    attention = recipe.attention if recipe.attention != "auto" else ("flex" if cuda else "sdpa")
    B = recipe.block_size

    # -- data and configs
    data = open_training_data(data_files, recipe)
    if len(data) == 0:
        raise ValueError("no training sequence has an anchor position (loss_mask empty?)")
    target_cfg = load_target_config(target_dir)
    layer_ids = list(recipe.target_layer_ids or getattr(data, "layer_ids", None) or []) or None
    config = DrafterConfig.from_target_config(
        target_cfg, num_layers=recipe.num_layers, block_size=B,
        mask_token_id=mask_token_id_in_dir(target_dir, recipe.mask_token_id), target_layer_ids=layer_ids)

    # -- models: fp32 master weights, bf16 autocast on GPU; the target's head is frozen, outside the optimizer
    torch.manual_seed(recipe.seed)
    drafter = DFlashDrafter(config).to(device)
    head = TargetHead.from_target_dir(target_dir, dtype=torch.bfloat16 if cuda else torch.float32, device=device)
    features = None
    if recipe.online:
        features = TargetFeatures(target_dir, config.target_layer_ids, device, torch.bfloat16 if cuda else torch.float32)
    compiled = recipe.compile and cuda
    if compiled:
        _allow_recompiles()
        for layer in drafter.layers:
            layer.compile()
    model = drafter
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(
            drafter, device_ids=[device.index] if cuda else None, broadcast_buffers=False)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay,
                                  **({"fused": True} if cuda else {}))
    plan = BatchPlan(len(data), recipe, world, rank)
    total = plan.total_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(total, recipe.warmup_ratio))

    # -- resume
    step, resumed_from = 0, None
    losses: list[float] = []
    acc_counts = {"epoch": 0, "correct": [0.0] * (B - 1), "count": [0.0] * (B - 1)}
    src = latest_state_dir(state_root) if resume else None
    if src is not None:
        doc, history = load_training_state(src, model, optimizer, scheduler, device)
        if doc["recipe_fingerprint"] != recipe.fingerprint() or doc["world_size"] != world:
            raise ValueError(f"{src} is a different run (recipe or world size changed); use a new out_dir")
        step = resumed_from = doc["step"]
        losses = history["losses"].tolist()
        acc_counts = doc["accuracy_counts"]

    # -- loop
    stop = min(total, max_steps) if max_steps is not None else total
    loader = BatchLoader(data, plan, step, stop, cuda) if step < stop else None
    gamma = recipe.loss_gamma
    tokens_seen, t_loop = 0, time.perf_counter()
    while step < stop:
        _, cpu_batch = loader.next()
        batch = cpu_batch.to(device)
        hidden = features(batch.input_ids) if features is not None else batch.hidden
        if not cuda:
            hidden = hidden.float()  # fp32 on CPU (the cache may hold bf16)
        stats, w_total = train_step(model, head, optimizer, batch, hidden, block_size=B,
                                    mask_token_id=config.mask_token_id, gamma=gamma, attention=attention,
                                    grad_clip=recipe.grad_clip, compiled_loss=compiled, world=world)
        scheduler.step()
        step += 1

        # metrics over the global batch
        stats = torch.cat([stats, torch.tensor([float(batch.num_tokens)], device=device)])
        if world > 1:
            dist.all_reduce(stats)
        stats = stats.cpu()
        step_loss = float(stats[0] / w_total.cpu().clamp_min(1e-6))
        losses.append(step_loss)
        tokens_seen += int(stats[-1])
        epoch = (step - 1) // plan.steps_per_epoch
        if epoch != acc_counts["epoch"]:
            acc_counts = {"epoch": epoch, "correct": [0.0] * (B - 1), "count": [0.0] * (B - 1)}
        acc_counts["correct"] = [a + float(c) for a, c in zip(acc_counts["correct"], stats[1:B])]
        acc_counts["count"] = [a + float(c) for a, c in zip(acc_counts["count"], stats[B : 2 * B - 1])]
        if log is not None and rank == 0:
            el = time.perf_counter() - t_loop
            log({"step": step, "total_steps": total, "epoch": epoch, "loss": step_loss, "tokens": int(stats[-1]),
                 "lr": scheduler.get_last_lr()[0], "tokens_per_s": tokens_seen / max(el, 1e-9),
                 "acc_by_pos": (stats[1:B] / stats[B : 2 * B - 1].clamp_min(1)).tolist()})
        if step % recipe.save_every == 0 or step == stop:
            _save_state(rank, world, state_root, step, model, optimizer, scheduler, recipe, total, losses, acc_counts)
    if loader is not None:
        loader.thread.join(timeout=5)
    t_loop = time.perf_counter() - t_loop

    ckpt = None
    if step >= total:
        ckpt = out / "drafter"
        if rank == 0:
            save_drafter(drafter, ckpt, dtype=getattr(torch, recipe.checkpoint_dtype),
                         metadata={"recipe": json.dumps(recipe.to_dict(), default=list)})
        if world > 1:
            dist.barrier()
    acc = [c / max(n, 1.0) for c, n in zip(acc_counts["correct"], acc_counts["count"])]
    return TrainResult(
        checkpoint_dir=ckpt, state_dir=latest_state_dir(state_root), steps=step, total_steps=total,
        losses=losses, tokens_per_s=tokens_seen / max(t_loop, 1e-9), accuracy_by_position=acc,
        resumed_from_step=resumed_from, wall_s=time.perf_counter() - t_start, num_sequences=len(data),
        world_size=world, config=config.to_hf_dict())


def _save_state(rank, world, state_root, step, model, optimizer, scheduler, recipe, total, losses, acc_counts):
    if rank == 0:
        trainer = {"recipe": recipe.to_dict(), "recipe_fingerprint": recipe.fingerprint(), "world_size": world,
                   "total_steps": total, "accuracy_counts": acc_counts}
        save_training_state(state_root, step, model, optimizer, scheduler, trainer,
                            {"losses": torch.tensor(losses, dtype=torch.float64)})
    if world > 1:
        dist.barrier()


# ----------------------------------------------------------------------------------------------
# CLI (torchrun entry point)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", required=True, help="recipe JSON file (DrafterRecipe fields)")
    p.add_argument("--data", nargs="+", required=True, help="cache / tokenized-sample files")
    p.add_argument("--target", required=True, help="target model directory")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--no-resume", action="store_true")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--result", default=None, help="write the TrainResult metrics JSON here (rank 0)")
    p.add_argument("--log-every", type=int, default=10)
    a = p.parse_args(argv)

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    recipe = DrafterRecipe.from_dict(json.loads(Path(a.recipe).read_text()))

    def log(m):
        if m["step"] % a.log_every == 0 or m["step"] == m["total_steps"]:
            print(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in m.items()
                              if k != "acc_by_pos"}), flush=True)

    res = train_drafter(recipe, a.data, a.target, a.out, resume=not a.no_resume, log=log, max_steps=a.max_steps)
    if _dist_info()[0] == 0 and a.result:
        Path(a.result).write_text(json.dumps({**res.metrics(), "losses": res.losses}))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
