"""The ``completions`` stage over the store: regenerate one ``raw_prompts`` partition with the target.

:func:`regenerate_partition` reads ``raw_prompts/<shard>.parquet`` and the
target's chat object (`TargetModelSpec.chat()`), and regenerates every assistant turn
over the fleet (``completions.regenerate_shard``: journaled as answers arrive,
so a crashed run resumes where it stopped). It writes the journal,
``completions/<shard>.parquet`` (one row per prompt) and
``completions/_failed/<shard>.parquet``; too many failed prompts publish
nothing (``TooManyFailedPrompts``), and no endpoint serving the target fails at
once (``NoEngineAvailable``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dflash_assets.generation.completions import CompletionsResult, ProgressUpdate, regenerate_shard
from dflash_assets.generation.config import GenerationConfig
from dflash_assets.generation.fleet import EngineFleetConfig, FleetProbe
from dflash_assets.store import layout

__all__ = ["regenerate_partition"]


def regenerate_partition(store: Any, shard: str, target: Any, fleet: EngineFleetConfig, *,
                         generation: GenerationConfig, max_failed_ratio: float = 0.01,
                         progress: Callable[[ProgressUpdate], None] | None = None,
                         on_probe: Callable[[FleetProbe], None] | None = None) -> CompletionsResult:
    """Regenerate the assistant turns of ``raw_prompts/<shard>.parquet`` on ``fleet`` and publish them.

    ``target`` is a ``TargetModelSpec`` (its chat object, ``target.chat()``: the tokenizer with the template
    override and the template kwargs, renders the prompts for engines that take token ids); ``generation`` the
    sampling (``enable_thinking``: ``target.thinking()``, the chat object's thinking flag).
    The target's ``generation_fingerprint()`` enters every row's ``config_hash``: a fine-tune written in place, or
    another directory of the same name, regenerates instead of resuming the old target's rows.
    ``progress`` and ``on_probe`` are ``regenerate_shard``'s. Raises ``NoEngineAvailable`` and
    ``TooManyFailedPrompts`` as it does.
    """
    return regenerate_shard(
        store.read_parquet(layout.raw_prompts(shard)), shard=shard, store=store, fleet=fleet,
        generation=generation, tokenizer=target.chat(), max_failed_ratio=max_failed_ratio,
        progress=progress, on_probe=on_probe, target_fingerprint=target.generation_fingerprint())
