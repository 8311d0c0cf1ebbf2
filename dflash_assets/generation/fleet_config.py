"""The engine fleet's configuration: its endpoints (``EndpointConfig``), the target they must serve, timeouts and
retries (``EngineFleetConfig``), and each endpoint's bearer token (``endpoint_api_key``).

Reads the token files and environment variables an endpoint names, nothing else. Writes nothing.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from dflash_assets.generation.engines.inprocess import slot_busy_concurrency
from dflash_assets.generation.engines.protocol import EngineKind

__all__ = ["SLOTS_IN_FLIGHT", "EndpointConfig", "EngineFleetConfig", "endpoint_api_key"]

# In-process requests have no timeout and wait in the slot engine's queue at no cost: with a whole shard in flight
# its long prompts reach their tiers at the start instead of as the input order brings them (1.07x through the
# completions stage on an H100, BENCHMARKS.md).
SLOTS_IN_FLIGHT = 65536


class EndpointConfig(BaseModel):
    """One generation endpoint. Kind transformers with the slots cache and no ``max_concurrency`` given: a whole
    shard in flight (``SLOTS_IN_FLIGHT``) and ``max_batch_rows`` from the default ``max_concurrency``."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="http(s)://host:port of the server; for kind 'transformers' a label (inprocess://...).")
    kind: EngineKind = Field("sglang", description="sglang (native /generate), openai (/v1/chat/completions), "
                             "transformers (in-process model.generate; explicit opt-in, slow).")
    max_concurrency: int = Field(32, ge=1, description="Requests in flight at once on this endpoint (transformers "
                                 "kind, slots cache: SLOTS_IN_FLIGHT unless given, see EndpointConfig).")
    served_model_name: str | None = Field(None, description="Name this endpoint serves the target under "
                                          "(overrides the fleet-wide alias).")
    name: str | None = None
    api_key: SecretStr | None = Field(None, description="Bearer token for this endpoint (masked in repr and dumps; "
                                      "default: the fleet's api_key).")
    api_key_env: str | None = Field(None, description="Name of an environment variable holding this endpoint's token.")
    api_key_file: str | None = Field(None, description="File holding this endpoint's token (a mounted secret).")
    extra_sampling_params: bool | None = Field(
        None, description="openai kind: send top_k/min_p/... (SGLang, vLLM). None: on unless the probe "
        "recognizes `transformers serve`, which rejects them.")
    reasoning_parser: bool | None = Field(
        None, description="openai kind: whether the server splits reasoning out of the content (SGLang "
        "--reasoning-parser, vLLM --reasoning-parser). None: from SGLang's /model_info at probe time; a server "
        "that does not say is treated as splitting only in replies that carry a reasoning field.")
    context_length: int | None = Field(None, ge=1, description="Context length of the served model (None: from "
                                       "/v1/models max_model_len at probe time; no check when neither says).")
    deterministic_inference: bool | None = Field(
        None, description="Whether a request's seed makes its output reproducible on this endpoint. None: from "
        "SGLang's /server_info enable_deterministic_inference (false when the server does not say).")
    model_path: str | None = Field(None, description="transformers kind: model dir (default: the fleet's target_model).")
    device: str = Field("cpu", description="transformers kind: torch device.")
    dtype: str = Field("auto", description="transformers kind: torch dtype of the weights, e.g. bfloat16 (auto: the "
                       "checkpoint's own).")
    cache: Literal["dynamic", "static", "continuous", "slots"] = Field(
        "dynamic", description="transformers kind: KV cache of `generate`; static pads batches to a few shapes and, "
        "on CUDA, compiles the decode step; continuous hands requests to transformers' continuous batching (paged "
        "cache: rows join and leave the running batch one by one; on an H200 without flash attention it runs at a "
        "quarter of static's speed, BENCHMARKS.md); slots decodes in max_batch_rows fixed KV slots refilled as "
        "rows end, the decode step a CUDA graph on CUDA (full-attention models; see TransformersEngine).")
    slot_len: int = Field(4096, ge=2, description="transformers kind, slots cache: positions per slot (prompt plus "
                          "new tokens; a longer request takes one of the long slots).")
    slot_tiers: list[tuple[int, int]] | None = Field(
        None, description="transformers kind, slots cache: (slots, positions) of further slot decoders for requests "
        "longer than slot_len, stepped beside the main one (None: a sixteenth of max_batch_rows, at least 4, of the "
        "model's context length; []: such requests run on the dynamic cache).")
    attention: Literal["sdpa", "packed_gqa"] = Field(
        "sdpa", description="transformers kind, dynamic or static cache: the attention function. packed_gqa decodes "
        "without copying the KV cache to every query head (grouped-query models; generation.packed_gqa), which "
        "Transformers' SDPA does under torch.compile, i.e. in the static cache's compiled decode step.")
    static_cache_len: Literal["largest", "per_call"] = Field(
        "largest", description="transformers kind, static cache: 'largest' sizes each call's cache to the largest "
        "call so far (transformers' default: no recompile); 'per_call' to the call itself (prompt width bucket + "
        "max_new_tokens), since every decode step attends over the whole cache (see TransformersEngine).")
    max_batch_tokens: int = Field(8192, ge=1, description="transformers kind: padded prompt tokens per generate "
                                  "call (requests are batched by similar length within it).")
    max_batch_rows: int | None = Field(None, ge=1, description="transformers kind: rows per generate call (None: "
                                       "max_concurrency). More requests in flight than rows lets each call fill "
                                       "its rows from prompts of one width. continuous: rows per decoding step.")

    @property
    def busy_concurrency(self) -> int:
        """Requests in flight that keep this endpoint busy (``Engine.busy_concurrency``): ``max_concurrency``, for
        the slots cache at most twice its rows."""
        if self.kind == "transformers" and self.cache == "slots":
            return slot_busy_concurrency(self.max_concurrency, self.max_batch_rows or self.max_concurrency)
        return self.max_concurrency

    @model_validator(mode="after")
    def _slots_in_flight(self) -> "EndpointConfig":
        if self.kind == "transformers" and self.cache == "slots" and "max_concurrency" not in self.model_fields_set:
            self.max_batch_rows = self.max_batch_rows or self.max_concurrency
            self.max_concurrency = SLOTS_IN_FLIGHT
        return self


class EngineFleetConfig(BaseModel):
    """Endpoints, the target they must serve, timeouts and retries."""

    model_config = ConfigDict(extra="forbid")

    endpoints: list[EndpointConfig] = Field(default_factory=list)
    target_model: str = Field(description="Target model name or path; endpoints serving anything else are refused.")
    served_model_name: str | None = Field(None, description="Also accept endpoints serving the target under this name.")
    probe_timeout_s: float = Field(10.0, gt=0)
    connect_timeout_s: float = Field(10.0, gt=0)
    request_timeout_s: float = Field(1800.0, gt=0, description="Whole-request limit (one assistant turn).")
    max_retries: int = Field(4, ge=0, description="Retries per request after the first attempt.")
    backoff_initial_s: float = Field(1.0, ge=0)
    backoff_max_s: float = Field(30.0, ge=0)
    dead_after_failures: int = Field(3, ge=1, description="Consecutive connection failures that mark an endpoint dead.")
    read_timeout_s: float | None = Field(
        300.0, gt=0, description="A request with no reply byte for this long (plus read_timeout_per_token_s per "
        "requested token: a non-streaming reply comes in one piece at the end) fails as a connection error, so a "
        "hung server is cut off well before request_timeout_s. None: only request_timeout_s.")
    read_timeout_per_token_s: float = Field(0.1, ge=0, description="Added to read_timeout_s per max_new_tokens.")
    max_response_bytes: int = Field(64 * 1024 * 1024, ge=1024, description="Larger reply bodies are cut off with "
                                    "an error.")
    api_key: SecretStr | None = Field(None, description="Bearer token sent to every endpoint without its own "
                                      "(masked in repr and dumps; never logged).")
    health_wait_s: float = Field(60.0, ge=0, description="How long a probe asks /health again while it answers 503 "
                                 "(SGLang: starting, or busy past its 20 s health generation).")
    health_timeout_s: float = Field(25.0, gt=0, description="One /health call (SGLang's waits up to 20 s for a token).")
    context_min_new_tokens: int = Field(
        64, ge=1, description="A request whose prompt leaves fewer new tokens than this in the context length is "
        "not sent (the conversation stops at its previous turn; a first turn fails as context_overflow); one "
        "that leaves more has max_new_tokens lowered to what fits.")

    @model_validator(mode="after")
    def _unique_urls(self) -> "EngineFleetConfig":
        urls = [e.url.rstrip("/") for e in self.endpoints]
        if len(set(urls)) != len(urls):
            raise ValueError(f"duplicate endpoint urls: {urls}")
        return self


def endpoint_api_key(ep: EndpointConfig, config: EngineFleetConfig) -> str | None:
    """The endpoint's bearer token: its own ``api_key``, ``api_key_file``, ``api_key_env``, else the fleet's.

    A named file or variable that is missing or empty is an error (a typo must not send requests unauthenticated).
    """
    if ep.api_key is not None:
        return ep.api_key.get_secret_value() or None
    if ep.api_key_file:
        try:
            key = Path(ep.api_key_file).read_text(encoding="utf-8").strip()
        except OSError as e:
            raise ValueError(f"endpoint {ep.url}: cannot read api_key_file {ep.api_key_file!r} ({e.strerror})") from None
        if not key:
            raise ValueError(f"endpoint {ep.url}: api_key_file {ep.api_key_file!r} is empty")
        return key
    if ep.api_key_env:
        key = os.environ.get(ep.api_key_env, "").strip()
        if not key:
            raise ValueError(f"endpoint {ep.url}: environment variable {ep.api_key_env} (api_key_env) is not set")
        return key
    if config.api_key is not None:
        return config.api_key.get_secret_value() or None
    return None
