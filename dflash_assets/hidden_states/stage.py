"""The ``hidden_state_cache`` stage over the store: capture a partition, publish it, and the Pipes entry.

Reads ``tokenized_samples/<shard>.parquet`` and its quality gate from the
store, captures the partition locally (:mod:`dflash_assets.hidden_states.capture`)
and writes (publishes) its part files under ``hidden_state_cache/<shard>/<version>/``,
then the manifest ``hidden_state_cache/<shard>.manifest.json`` naming them
(``store.manifest``: a kill leaves readers the old set or the new one). :func:`pipes_stage`
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
from dflash_assets.store.manifest import manifest_files, publish_files, remove_stale_scratch, scratch_prefix

__all__ = ["write_hidden_state_cache", "cache_partition_for_shard", "pipes_stage"]

logger = logging.getLogger(__name__)


def write_hidden_state_cache(store: Any, shard: str, samples: Any, spec: CaptureSpec, *,
                             devices: Sequence[str] = ("cpu",), models: Sequence[nn.Module] | None = None,
                             scratch_dir: str | os.PathLike | None = None, used_bytes: int = 0) -> CaptureResult:
    """Capture a partition into a local scratch dir, then publish its parts through ``store`` as one.

    The parts go to ``hidden_state_cache/<shard>/<version>/<shard>[-0000k-of-0000n].safetensors``, then
    the manifest ``hidden_state_cache/<shard>.manifest.json`` names them (written last: readers see the
    old complete set until then), then parts of older publications, and those written before
    manifests, are deleted. Scratch directories of killed earlier runs are removed first, this run's
    afterwards. Returns the result with ``keys`` set.
    """
    scratch_root = Path(scratch_dir or tempfile.gettempdir())
    for gone in remove_stale_scratch(scratch_root, "hidden"):
        logger.info("removed %s, left by a run that no longer runs", gone)
    tmp = Path(tempfile.mkdtemp(prefix=scratch_prefix("hidden"), dir=scratch_root))
    try:
        result = capture_partition(samples, spec, tmp, stem=shard, devices=devices, models=models,
                                   used_bytes=used_bytes)
        legacy = [k for k in store.list(layout.HIDDEN_STATE_CACHE) if _legacy_part(k, shard)]
        manifest = publish_files(
            store, layout.hidden_state_manifest(shard), layout.hidden_state_versions(shard),
            {p.name: p for p in result.paths}, stale=legacy,
            extra={"shard": shard, "num_samples": result.num_samples, "num_tokens": result.num_tokens,
                   "layer_ids": list(result.layer_ids), "upstream_data_version": spec.upstream_data_version})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dataclasses.replace(result, keys=tuple(manifest_files(manifest).values()))


def _legacy_part(key: str, shard: str) -> bool:
    """A part of ``shard`` written before manifests (``hidden_state_cache/<shard>[-k-of-n].safetensors``)."""
    pattern = rf"{re.escape(layout.HIDDEN_STATE_CACHE)}/{re.escape(shard)}(-\d{{5}}-of-\d{{5}})?\.safetensors"
    return re.fullmatch(pattern, key) is not None


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
    # one listing of the cache and one read per manifest (sizes are in the manifests), not a request per part
    used = sum(e["bytes"] if e["bytes"] is not None else store.size(e["key"])
               for other, entries in layout.list_hidden_state_entries(store).items() if other != shard
               for e in entries)
    dtype = "float32" if all(str(d).startswith("cpu") for d in devices) and target.dtype != "bfloat16" else "bfloat16"
    spec = CaptureSpec(
        target=target.model_path, layer_ids=tuple(facts.layer_ids), target_id=target.model_path, dtype=dtype,
        tokens_per_batch=tokens_per_batch, max_part_bytes=max_part_bytes, budget_bytes=budget_bytes,
        tokenizer_hash=facts.tokenizer_hash, upstream_data_version=gate["data_version"],
    )
    log(f"{shard}: capturing layers {list(facts.layer_ids)} of {table.num_rows} samples on {list(devices)} ({dtype})")
    result = write_hidden_state_cache(store, shard, table, spec, devices=devices, scratch_dir=scratch_dir,
                                      used_bytes=used)
    per_token = bytes_per_token(len(facts.layer_ids), facts.hidden_size, dtype)
    corpus_samples = _corpus_prompts(store) or table.num_rows
    projected = projected_corpus_bytes(corpus_samples, result.num_tokens / max(1, result.num_samples),
                                       len(facts.layer_ids), facts.hidden_size, dtype)
    log(f"{shard}: {result.num_tokens} tokens at {result.tokens_per_second:.0f} tok/s, "
        f"{result.bytes / 1e9:.3f} GB; whole corpus projected at {projected / 1e12:.3f} TB")
    return {**result.to_metadata(), "bytes_per_token_hidden": per_token, "dtype": dtype,
            "cache_used_gb_before": round(used / 1e9, 3), "corpus_samples": corpus_samples,
            "projected_corpus_tb": round(projected / 1e12, 6), "upstream_data_version": gate["data_version"],
            "target": target.model_path}


def _corpus_prompts(store: Any) -> int | None:
    """Prompts in the whole corpus (the ingest's index), for the projected cache size."""
    from dflash_assets.prompts.corpus import corpus_prompt_count

    return corpus_prompt_count(store) or None


def pipes_stage(call: Any) -> Any:
    """Entry point of ``python -m dflash_assets.pipes_worker hidden_state_cache`` (see pipes_worker)."""
    from dflash_assets.stage_io import StageResult
    from dflash_assets.target_model.spec import TargetModelSpec

    cfg = dict(call.config)
    target = TargetModelSpec(**cfg.pop("target"))
    meta = cache_partition_for_shard(call.store, call.partition_key, target, log=call.log.info, **cfg)
    return StageResult(metadata=meta, data_version=meta["upstream_data_version"])
