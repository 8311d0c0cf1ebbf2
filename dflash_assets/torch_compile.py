"""The torch.compile settings the project's compiled paths share: drafter training and the in-process engine's
static-cache decode step.

Reads and writes nothing but torch's global compile configuration: the inductor option a torch version needs
(``apply_inductor_workarounds``) and dynamo's recompile limit (``allow_recompiles``), so varying batch shapes
recompile instead of falling back to eager. ``flex_attention`` is flex attention as both users of it call it
(the drafter's blocks, slot decoding's rows of their own lengths): compiled on CUDA, one compiled function per
shape policy, with the Triton tile options ``set_flex_kernel_options`` chose (none: flex's own; ``flex_kernel_options``
sets them for a block of code, ``drafter_flex_kernel_options`` names those the drafter's training step runs with on
a GPU where they were measured faster); ``is_block_mask`` and ``block_mask_from_kv_blocks`` are the one place
flex's ``BlockMask`` class is looked up.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator


def needs_coalesce_tiling_workaround(torch_version: str) -> bool:
    """Whether this torch's inductor needs ``triton.coalesce_tiling_analysis = False`` to compile the drafter.

    torch 2.11's inductor asserts in ``tiling_utils.get_pw_red_splits`` while compiling the small drafter
    layers (pytorch/pytorch#197077); turning the coalescing analysis off avoids
    it. Only 2.11.x is known to need it: other versions keep inductor's default."""
    parts = torch_version.split("+")[0].split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return False
    return (major, minor) == (2, 11)


def apply_inductor_workarounds(torch_version: str | None = None) -> dict[str, Any]:
    """Set the inductor options this torch version needs before compiling; returns what was set."""
    import torch

    version = torch_version or torch.__version__
    applied: dict[str, Any] = {}
    if needs_coalesce_tiling_workaround(version):
        import torch._inductor.config as inductor_config

        triton_cfg = inductor_config.triton
        if hasattr(triton_cfg, "coalesce_tiling_analysis"):
            triton_cfg.coalesce_tiling_analysis = False
            applied["triton.coalesce_tiling_analysis"] = False
    return applied


def allow_recompiles(limit: int = 64) -> None:
    """Let dynamo recompile up to `limit` times per function (it turns a dim dynamic after its first change)
    instead of falling back to eager after its default 8."""
    import torch

    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name) and getattr(cfg, name) < limit:
            setattr(cfg, name, limit)


_COMPILED_FLEX: dict[bool, Any] = {}  # static_shapes -> torch.compile(flex_attention)
_FLEX_KERNEL_OPTIONS: dict[str, Any] = {}


def set_flex_kernel_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """The ``kernel_options`` every later `flex_attention` call passes (Triton tiles and launch settings, e.g.
    ``{"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}``; None or empty: flex's own choice per
    GPU and head size); returns the ones before. A graph compiled already keeps the options it was traced with."""
    before = dict(_FLEX_KERNEL_OPTIONS)
    _FLEX_KERNEL_OPTIONS.clear()
    _FLEX_KERNEL_OPTIONS.update(options or {})
    return before


def current_flex_kernel_options() -> dict[str, Any]:
    """The ``kernel_options`` later `flex_attention` calls pass (empty: flex's own)."""
    return dict(_FLEX_KERNEL_OPTIONS)


@contextlib.contextmanager
def flex_kernel_options(options: dict[str, Any] | None) -> Iterator[dict[str, Any]]:
    """`set_flex_kernel_options(options)` inside the block, the options before it restored after."""
    before = set_flex_kernel_options(options)
    try:
        yield dict(options or {})
    finally:
        set_flex_kernel_options(before)


# Flex attention's Triton tiles for the drafter's training step, by (CUDA capability, head dim), where they were
# measured faster than flex's own choice: on an H100 (sm90) at head dim 64 (SmolLM2-135M's drafter), 128 x 128
# tiles with 8 warps in 2 stages make the compiled step 1.22x faster at 96 samples a batch (`bench/drafter_training.py
# --varied-only`, BENCHMARKS.md "Drafter training"). Elsewhere flex chooses.
DRAFTER_FLEX_TILES: dict[tuple[tuple[int, int], int], dict[str, int]] = {
    ((9, 0), 64): {"BLOCK_M": 128, "BLOCK_N": 128, "num_stages": 2, "num_warps": 8},
}


def drafter_flex_kernel_options(device: Any, head_dim: int) -> dict[str, Any]:
    """The tiles `DRAFTER_FLEX_TILES` names for `device` (a CUDA device's capability) and `head_dim`; empty
    elsewhere (a CPU, another GPU or head size: flex's own)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return {}
    capability = tuple(torch.cuda.get_device_capability(device))
    return dict(DRAFTER_FLEX_TILES.get((capability, int(head_dim)), {}))


def flex_attention(query, key, value, block_mask, *, scale: float | None = None, static_shapes: bool = False):
    """``torch.nn.attention.flex_attention`` with grouped-query heads (``enable_gqa``) over `block_mask`.

    Traced as it is inside a graph being compiled; compiled on CUDA otherwise (eager flex computes every score),
    eager on a CPU. `static_shapes`: one compile per shape (a CUDA-graph-captured step's fixed views) instead of
    shapes made dynamic after their first change (training batches of varying widths)."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention as flex

    options = {"kernel_options": dict(_FLEX_KERNEL_OPTIONS)} if _FLEX_KERNEL_OPTIONS else {}
    if torch.compiler.is_compiling() or not query.is_cuda:
        return flex(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=True, **options)
    compiled = _COMPILED_FLEX.get(static_shapes)
    if compiled is None:
        if static_shapes:
            allow_recompiles()
        compiled = _COMPILED_FLEX[static_shapes] = torch.compile(flex, dynamic=False if static_shapes else None)
    return compiled(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=True, **options)


def block_mask_type() -> type | None:
    """flex attention's ``BlockMask`` class; None where this torch has no flex attention (torch < 2.5).
    A plain import, no cache wrapper: the drafter's compiled layers trace it."""
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:
        return None
    return BlockMask


def is_block_mask(mask: Any) -> bool:
    """Whether `mask` is a flex ``BlockMask`` (attention goes through `flex_attention` rather than SDPA)."""
    cls = block_mask_type()
    return cls is not None and isinstance(mask, cls)


@functools.cache
def _has_compute_q_blocks() -> bool:
    import inspect

    return "compute_q_blocks" in inspect.signature(block_mask_type().from_kv_blocks).parameters


def block_mask_from_kv_blocks(*args, forward_only: bool = False, **kwargs):
    """``BlockMask.from_kv_blocks``; `forward_only` skips the query-side block lists a backward reads, where
    this torch has that option (asked once)."""
    if forward_only and _has_compute_q_blocks():
        kwargs["compute_q_blocks"] = False
    return block_mask_type().from_kv_blocks(*args, **kwargs)
