"""The embedded default target, and the engine command that serves it: what runs when nothing is configured.

The target is the tiny dense Qwen3 of `tiny_targets` (built on first use into
the local cache), used in float32 on CPU, where its bf16 weights decode several
times slower. Reads the cache; writes it on first use.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, Sequence

from dflash_assets.embedded.tiny_targets import tiny_target_path
from dflash_assets.generation.server import EngineServer, local_engine_server
from dflash_assets.target_model.spec import TargetModelSpec

__all__ = ["EMBEDDED_DTYPE", "embedded_default_target", "default_target_spec", "embedded_engine_server"]

EMBEDDED_DTYPE = "float32"


def embedded_default_target(cache_dir: str | Path | None = None) -> Path:
    """The directory of the tiny dense target, built on first use."""
    return tiny_target_path("dense", cache_dir)


def default_target_spec(cache_dir: str | Path | None = None) -> TargetModelSpec:
    """The embedded default target as a `TargetModelSpec` (float32 for CPU)."""
    return TargetModelSpec(model_path=str(embedded_default_target(cache_dir)), dtype=EMBEDDED_DTYPE)


def embedded_engine_server(kind: Literal["sglang", "transformers"] = "transformers", *, port: int | None = 0,
                           host: str = "127.0.0.1", log_path: str | os.PathLike | None = None,
                           extra_args: Sequence[str] = (), **kwargs) -> EngineServer:
    """An `EngineServer` (not started) for the tiny target: `transformers serve` in float32 by default."""
    dtype = EMBEDDED_DTYPE if kind == "transformers" else None
    return local_engine_server(kind, embedded_default_target(), port=port, host=host, log_path=log_path,
                               extra_args=extra_args, dtype=dtype, **kwargs)
