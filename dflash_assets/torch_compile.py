"""The torch.compile settings the project's compiled paths share: drafter training and the in-process engine's
static-cache decode step.

Reads and writes nothing but torch's global compile configuration: the inductor option a torch version needs
(``apply_inductor_workarounds``) and dynamo's recompile limit (``allow_recompiles``), so varying batch shapes
recompile instead of falling back to eager.
"""

from __future__ import annotations

from typing import Any


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
