"""Generation engine clients: one interface (``protocol.Engine``) over three kinds of engine, one module each.

- ``sglang.SGLangEngine``: SGLang's native ``/generate`` API (also behind sglang-router);
- ``openai.OpenAIEngine``: ``/v1/chat/completions`` of SGLang, vLLM or ``transformers serve``;
- ``inprocess.TransformersEngine``: in-process ``model.generate``, its parts in ``inprocess_models`` (the shared
  model), ``inprocess_batching`` (the batched generate) and ``inprocess_caches`` (continuous batching, slots).

The two HTTP kinds share ``http.HttpEngine`` (transport, guards against a broken or hostile server, the probe).
``GenerationConfig`` (``generation.config``) holds the sampling settings and gives the ``config_hash`` stored with
every completion row; starting a server on a host is ``generation.server``'s job.

This package re-exports the names its callers use, so ``from dflash_assets.generation.engines import
SGLangEngine`` works whichever module defines it.
"""

from dflash_assets.generation.config import GenerationConfig, hf_generation_settings, normalize_model_id
from dflash_assets.generation.engines.http import RETRYABLE_STATUS, HttpEngine, json_dumps, json_loads
from dflash_assets.generation.engines.inprocess import TransformersEngine
from dflash_assets.generation.engines.inprocess_batching import (STATIC_MAX_WIDTH, STATIC_ROW_BUCKETS,
                                                                 STATIC_WIDTH_BUCKETS, next_batch, static_batch_shape,
                                                                 static_row_cap, static_width)
from dflash_assets.generation.engines.inprocess_models import release_idle_models
from dflash_assets.generation.engines.openai import OpenAIEngine
from dflash_assets.generation.engines.protocol import (ChatResult, ContextOverflow, Engine, EngineError, EngineKind,
                                                       EngineProbe, ServerFacts, decoding_over_run)
from dflash_assets.generation.engines.sglang import SGLangEngine
from dflash_assets.target_model.chat_template import split_reasoning_text

__all__ = [
    "EngineKind", "GenerationConfig", "ChatResult", "EngineProbe", "EngineError", "ContextOverflow", "ServerFacts",
    "Engine", "HttpEngine", "SGLangEngine", "OpenAIEngine", "TransformersEngine", "decoding_over_run",
    "RETRYABLE_STATUS", "json_dumps", "json_loads",
    "STATIC_MAX_WIDTH", "STATIC_ROW_BUCKETS", "STATIC_WIDTH_BUCKETS", "static_width", "static_row_cap",
    "static_batch_shape", "next_batch", "release_idle_models",
    "normalize_model_id", "hf_generation_settings", "split_reasoning_text",
]
