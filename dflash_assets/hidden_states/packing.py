"""Which targets the capture may pack, and the packed causal attention it runs them with.

Samples concatenated in one row never attend to each other: the attention implementation ``"packed_causal"``
(`target_model.packed_attention`, re-exported here) keeps them apart. Hybrid targets (Gated DeltaNet layers) are
packed only when flash-linear-attention and causal-conv1d are importable on a CUDA device
(:func:`resolve_packing`); otherwise equal-length samples stack as rows. Reads and writes nothing. Imports only
torch and transformers.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any, Literal

import torch

from dflash_assets.target_model.layer_capture import text_config
from dflash_assets.target_model.packed_attention import (ATTN_IMPLEMENTATION, packed_attention,
                                                         packed_causal_attention, register_packed_attention)

__all__ = [
    "ATTN_IMPLEMENTATION",
    "Packing",
    "packed_causal_attention",
    "register_packed_attention",
    "packed_attention",
    "is_hybrid",
    "linear_attention_kernels",
    "resolve_packing",
]

logger = logging.getLogger(__name__)

Packing = Literal["auto", "packed", "same_length"]


def is_hybrid(config_or_model: Any) -> bool:
    """True when the target has linear-attention (Gated DeltaNet) layers."""
    config = getattr(config_or_model, "config", config_or_model)
    types = getattr(text_config(config), "layer_types", None) or []
    return any(t != "full_attention" and "sliding" not in t for t in types)


def linear_attention_kernels() -> dict[str, bool]:
    """Which linear-attention kernel packages are importable: ``{"fla": ..., "causal_conv1d": ...}``."""
    return {name: importlib.util.find_spec(name) is not None for name in ("fla", "causal_conv1d")}


def resolve_packing(model_or_config: Any, device: str | torch.device, packing: Packing = "auto") -> bool:
    """Whether batches may concatenate samples in one row (True) or only stack equal lengths (False)."""
    if not is_hybrid(model_or_config):
        return packing != "same_length"
    kernels = linear_attention_kernels()
    exact_packed = all(kernels.values()) and torch.device(device).type == "cuda"
    if not all(kernels.values()):
        logger.warning(
            "hybrid target without linear-attention kernels (%s not importable): transformers' PyTorch "
            "fallback is slow and cannot keep packed samples apart, so only samples of equal length share "
            "a forward. Install 'dflash-assets[fla]' (flash-linear-attention, causal-conv1d) on GPU hosts.",
            ", ".join(k for k, ok in kernels.items() if not ok))
    if packing == "packed" and not exact_packed:
        raise ValueError("packing='packed' for a hybrid target needs flash-linear-attention and causal-conv1d "
                         "on a CUDA device; use packing='auto' or 'same_length'")
    return exact_packed and packing != "same_length"

