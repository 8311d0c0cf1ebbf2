"""Packed causal attention: samples concatenated in one row never attend to each other.

Registers the attention implementation ``"packed_causal"`` with Transformers: causal attention inside each
sample only (``cu_seq_lens_q``), through ``torch.nn.attention.varlen.varlen_attn`` (flash varlen) on CUDA, or
one causal SDPA call per sample elsewhere. The hidden-state capture and online training run the target with it
(``hidden_states.packing``); slot decoding's packed prefill reaches it through ``generation.packed_gqa``.
``packed_row`` builds the keyword arguments that lay samples out in such a row. Reads and writes nothing. Imports
only torch and transformers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_assets.target_model.layer_capture import text_config

__all__ = ["ATTN_IMPLEMENTATION", "packed_attention", "packed_causal_attention", "packed_row", "packed_row_kwargs",
           "register_packed_attention"]

# No "flash" in the name: transformers treats any name containing it as a flash-attention request.
ATTN_IMPLEMENTATION = "packed_causal"


try:  # torch >= 2.9 on CUDA: flash-attention varlen with cu_seqlens
    import inspect as _inspect

    from torch.nn.attention.varlen import varlen_attn as _varlen_attn

    _VARLEN_PARAMS = frozenset(_inspect.signature(_varlen_attn).parameters)
except Exception:  # pragma: no cover - depends on the torch build
    _varlen_attn, _VARLEN_PARAMS = None, frozenset()


def _varlen_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int,
                   scale: float | None) -> torch.Tensor | None:
    """Causal flash varlen over (T, H, D) tensors, adapting to the torch version's signature; None if unusable."""
    kw: dict[str, Any] = {}
    if scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        if "scale" not in _VARLEN_PARAMS:
            return None
        kw["scale"] = scale
    if "window_size" in _VARLEN_PARAMS:  # torch >= 2.12
        kw["window_size"] = (-1, 0)
    elif "is_causal" in _VARLEN_PARAMS:
        kw["is_causal"] = True
    else:
        return None
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in _VARLEN_PARAMS:
            kw["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return _varlen_attn(q, k, v, cu, cu, max_len, max_len, **kw)


def packed_causal_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None,
                            dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Causal attention that never crosses sample boundaries given by ``cu_seq_lens_q``.

    query [B, Hq, T, D], key/value [B, Hkv, T, D] -> ([B, T, Hq, D], None).
    Without ``cu_seq_lens_q`` each row is one sample (stacked batches).
    """
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError("packed_causal attention does not implement sliding windows")
    cu = kwargs.get("cu_seq_lens_q")
    gqa = query.shape[1] != key.shape[1]
    if cu is None or cu.numel() <= 2:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2).contiguous(), None
    if query.shape[0] != 1:
        raise ValueError("packed batches are one row")
    if query.is_cuda and _varlen_attn is not None and query.dtype in (torch.float16, torch.bfloat16):
        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (T, H, D)
        max_len = kwargs.get("max_length_q") or int((cu[1:] - cu[:-1]).max())
        out = _varlen_causal(q, k, v, cu.to(torch.int32), max_len, scaling)
        if out is not None:
            return out.unsqueeze(0), None  # (1, T, Hq, D)
    bounds = cu.tolist()
    out = torch.empty_like(query)
    for a, b in zip(bounds[:-1], bounds[1:]):
        out[:, :, a:b] = F.scaled_dot_product_attention(
            query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


def packed_row_kwargs(bounds: torch.Tensor, positions: torch.Tensor, max_length: int) -> dict[str, Any]:
    """A model's keyword arguments for one packed row: `bounds` (int32, samples + 1) where each sample starts and
    the row ends, `positions` (tokens,) each token's position in its sample, `max_length` at least the longest."""
    return {"position_ids": positions[None], "cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds,
            "max_length_q": max_length, "max_length_k": max_length}


def packed_row(lengths: Sequence[int], device: torch.device | str, *, pin: bool = False) -> dict[str, Any]:
    """`packed_row_kwargs` for samples of `lengths` tokens one after another, built on the host and copied to
    `device` once each (from pinned memory with `pin`, without waiting)."""
    counts = torch.as_tensor(lengths, dtype=torch.int64)
    bounds = torch.zeros(len(counts) + 1, dtype=torch.int32)
    torch.cumsum(counts, 0, out=bounds[1:])
    positions = torch.arange(int(bounds[-1])) - torch.repeat_interleave(bounds[:-1].long(), counts)
    move = lambda t: (t.pin_memory() if pin else t).to(device, non_blocking=pin)  # noqa: E731
    return packed_row_kwargs(move(bounds), move(positions), int(counts.max()))


def register_packed_attention() -> str:
    """Register ``"packed_causal"`` with transformers' AttentionInterface; returns the name.

    No mask function is registered, so transformers builds no attention mask
    for it (no [T, T] tensor for a 16K-token row).
    """
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, packed_causal_attention)
    return ATTN_IMPLEMENTATION



@contextlib.contextmanager
def packed_attention(model: nn.Module):
    """Temporarily switch a model's attention implementation to ``packed_causal``."""
    register_packed_attention()
    configs = {id(c): c for c in (model.config, text_config(model.config)) if c is not None}
    saved = {k: c._attn_implementation for k, c in configs.items()}
    try:
        for c in configs.values():
            c._attn_implementation = ATTN_IMPLEMENTATION
        yield
    finally:
        for k, c in configs.items():
            c._attn_implementation = saved[k]
