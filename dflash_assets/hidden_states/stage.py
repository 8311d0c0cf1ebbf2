"""The ``hidden_state_cache`` stage over the store: capture a partition, publish it, and the Pipes entry.

Reads ``tokenized_samples/<shard>.parquet`` and its quality gate from the
store, captures the partition locally (:mod:`dflash_assets.hidden_states.capture`)
and publishes its part files under ``hidden_state_cache/``. :func:`pipes_stage`
is what ``python -m dflash_assets.pipes_worker hidden_state_cache`` runs.
Imports torch and transformers through the capture module.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from dflash_assets.hidden_states.capture import CaptureResult, CaptureSpec, capture_partition
from dflash_assets.store import layout

__all__ = ["write_hidden_state_cache", "cache_partition_for_shard", "pipes_stage"]

logger = logging.getLogger(__name__)


def write_hidden_state_cache(store: Any, key_prefix: str, samples: Any, spec: CaptureSpec, *,
                             stem: str, devices: Sequence[str] = ("cpu",), models: Sequence[nn.Module] | None = None,
                             scratch_dir: str | os.PathLike | None = None, used_bytes: int = 0) -> CaptureResult:
    """Capture a partition into a local scratch dir, then publish each part atomically through ``store``.

    Keys: ``{key_prefix}/{stem}.safetensors`` or ``{key_prefix}/{stem}-0000k-of-0000n.safetensors``.
    Parts of an earlier run of the same stem that this run did not write (a
    different part count) are deleted after the new ones are published.
    Scratch files are removed afterwards. Returns the result with ``keys`` set.
    """
    prefix = key_prefix.strip("/")
    tmp = Path(tempfile.mkdtemp(prefix="dflash-hidden-", dir=scratch_dir))
    try:
        result = capture_partition(samples, spec, tmp, stem=stem, devices=devices, models=models,
                                   used_bytes=used_bytes)
        keys = []
        for p in result.paths:
            key = f"{prefix}/{p.name}"
            store.upload_file(key, p)
            keys.append(key)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ours = re.compile(rf"{re.escape(prefix)}/{re.escape(stem)}(-\d{{5}}-of-\d{{5}})?\.safetensors")
    for old in store.list(prefix):
        if ours.fullmatch(old) and old not in keys:
            store.delete(old)
    return dataclasses.replace(result, keys=tuple(keys))



# ----------------------------------------------------------------------------
# The partition as a stage: what the `hidden_state_cache` asset runs on the GPU host

def cache_partition_for_shard(store: Any, shard: str, target: Any, *, devices: Sequence[str] = ("cpu",),
                              tokens_per_batch: int = 16384, budget_bytes: int | None = None,
                              max_part_bytes: int = 16 * 2**30, scratch_dir: str | None = None,
                              log: Callable[[str], None] = logger.info) -> dict[str, Any]:
    """Capture one ``tokenized_samples`` partition into ``hidden_state_cache/<shard>*.safetensors``.

    ``target`` is a ``TargetModelSpec``. Refuses (``QualityGateFailed``) a
    partition whose blocking sample checks failed, and (``StorageBudgetExceeded``)
    one that would push the cache past ``budget_bytes``. Returns metadata:
    the capture's numbers, GB of this partition, and the projected size of
    the whole corpus's cache at this partition's tokens per sample.
    """
    from dflash_assets.hidden_states.format import bytes_per_token, projected_corpus_bytes
    from dflash_assets.tokenization.quality import read_verified_samples, require_quality_gate

    gate = require_quality_gate(store, shard)
    facts = target.validate()
    table = read_verified_samples(store, shard, gate, columns=["prompt_id", "input_ids", "loss_mask", "num_tokens"])
    used = sum(store.size(k) for other, parts in layout.list_hidden_state_parts(store).items() if other != shard
               for k in parts)
    dtype = "float32" if all(str(d).startswith("cpu") for d in devices) and target.dtype != "bfloat16" else "bfloat16"
    spec = CaptureSpec(
        target=target.model_path, layer_ids=tuple(facts.layer_ids), target_id=target.model_path, dtype=dtype,
        tokens_per_batch=tokens_per_batch, max_part_bytes=max_part_bytes, budget_bytes=budget_bytes,
        tokenizer_hash=facts.tokenizer_hash, upstream_data_version=gate["data_version"],
    )
    log(f"{shard}: capturing layers {list(facts.layer_ids)} of {table.num_rows} samples on {list(devices)} ({dtype})")
    result = write_hidden_state_cache(store, layout.HIDDEN_STATE_CACHE, table, spec, stem=shard, devices=devices,
                                      scratch_dir=scratch_dir, used_bytes=used)
    per_token = bytes_per_token(len(facts.layer_ids), facts.hidden_size, dtype)
    corpus_samples = _corpus_prompts(store) or table.num_rows
    projected = projected_corpus_bytes(corpus_samples, result.num_tokens / max(1, result.num_samples),
                                       len(facts.layer_ids), facts.hidden_size, dtype)
    log(f"{shard}: {result.num_tokens} tokens at {result.tokens_per_second:.0f} tok/s, "
        f"{result.bytes / 1e9:.3f} GB; whole corpus projected at {projected / 1e12:.3f} TB")
    return {**result.metadata(), "bytes_per_token_hidden": per_token, "dtype": dtype,
            "cache_used_gb_before": round(used / 1e9, 3), "corpus_samples": corpus_samples,
            "projected_corpus_tb": round(projected / 1e12, 6), "upstream_data_version": gate["data_version"],
            "target": target.model_path}


def _corpus_prompts(store: Any) -> int | None:
    """Prompts in the whole corpus (the ingest's index), for the projected cache size."""
    from dflash_assets.prompts.ingest import corpus_prompt_count

    return corpus_prompt_count(store) or None


def pipes_stage(call: Any) -> Any:
    """Entry point of ``python -m dflash_assets.pipes_worker hidden_state_cache`` (see pipes_worker)."""
    from dflash_assets.stage_io import StageResult
    from dflash_assets.target.spec import TargetModelSpec

    cfg = dict(call.config)
    target = TargetModelSpec(**cfg.pop("target"))
    meta = cache_partition_for_shard(call.store, call.partition_key, target, log=call.log.info, **cfg)
    return StageResult(metadata=meta, data_version=meta["upstream_data_version"])
