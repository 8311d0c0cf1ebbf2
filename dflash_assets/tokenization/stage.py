"""The ``tokenized_samples`` stage over the store: tokenize one completions partition, check it, publish it.

:func:`tokenize_partition` reads ``completions/<shard>.parquet`` and the target
(its chat object, ``spec.chat()``: tokenizer, renderer with the template
kwargs, conventions), renders and tokenizes every conversation
(``samples.tokenize_completions``) with the supervised span delimited by the
target's own assistant header and end of turn (read off its template:
``chat().conventions``), runs the sample checks and writes
``tokenized_samples/<shard>.parquet`` with its quality gate
``tokenized_samples/<shard>.quality.json`` (``quality.publish_samples``: gate
pending, samples, then the gate naming the samples' sha256). The fast encoder
(parity-checked when built) and the renderer of a target are built once per
process (:func:`target_encoder`), keyed by the spec's fingerprint.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from dflash_assets.stage_io import CheckOutcome
from dflash_assets.store import layout
from dflash_assets.target_model.chat_template import ChatRenderer
from dflash_assets.tokenization.encoder import build_encoder
from dflash_assets.tokenization.quality import QualityThresholds, publish_samples
from dflash_assets.tokenization.samples import TokenizeConfig, TokenizeStats, tokenize_completions

__all__ = ["TokenizedPartition", "target_encoder", "tokenize_partition"]

logger = logging.getLogger(__name__)

_ENCODERS: dict[str, tuple[Any, ChatRenderer]] = {}


def target_encoder(target: Any) -> tuple[Any, ChatRenderer]:
    """One fast encoder (parity-checked at build) and chat renderer per target (``TargetModelSpec``), per process:
    the encoder of the target's chat object's tokenizer, and that chat object's renderer (``target.chat()``)."""
    key = target.config_fingerprint()
    if key not in _ENCODERS:
        chat = target.chat()
        _ENCODERS[key] = (build_encoder(chat.tokenizer), chat.renderer)
    return _ENCODERS[key]


@dataclass(frozen=True)
class TokenizedPartition:
    """What a published partition holds: its samples, how they were made, and its checks' outcomes."""

    table: pa.Table
    stats: TokenizeStats
    data_version: str  # the first 16 hex digits of the samples' sha256, as the quality gate records them
    outcomes: dict[str, CheckOutcome]


def tokenize_partition(store: Any, shard: str, target: Any, config: TokenizeConfig = TokenizeConfig(),
                       thresholds: QualityThresholds | None = None, *,
                       log: Callable[[str], None] = logger.info) -> TokenizedPartition:
    """Tokenize ``completions/<shard>.parquet`` for ``target`` and publish the samples with their quality gate.

    ``config``'s ``assistant_header`` and ``end_of_turn`` are replaced by the target's (read off its template).
    ``thresholds``: the checks' (``thinking_requested``: whether the target thinks, ``target.thinking()``);
    None: the defaults, with ``thinking_requested`` the target's.
    """
    encoder, renderer = target_encoder(target)
    chat = target.chat().conventions
    if thresholds is None:
        thresholds = QualityThresholds(thinking_requested=chat.thinking)
    config = dataclasses.replace(config, assistant_header=chat.assistant_header, end_of_turn=chat.end_of_turn)
    table, stats = tokenize_completions(store.read_parquet(layout.completions(shard)), encoder, config,
                                        template=renderer)
    # gate pending, samples, then the gate naming the samples' sha256: a kill in between leaves a blocking gate
    published = publish_samples(store, shard, table, thresholds)
    log(f"{shard}: {stats.samples} samples from {stats.conversations} conversations, "
        f"{stats.tokens} tokens ({stats.loss_tokens} supervised), dropped {stats.dropped or 'none'}")
    return TokenizedPartition(table, stats, published.data_version, published.outcomes)
