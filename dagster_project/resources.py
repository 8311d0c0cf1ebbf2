"""Resources shared by the stages: the store and the target model.

The store is addressed by one URI (a local directory by default, or
``s3://bucket/prefix``); S3 clients come from dagster-aws's ``S3Resource``,
with credentials from the environment (never logged).
"""


import os
from typing import Optional

import dagster as dg
from pydantic import Field

from dflash_assets.store import LocalStore, S3Store, default_store_uri, open_store


class StoreResource(dg.ConfigurableResource):
    """Where every asset's data lives: a local directory or ``s3://bucket/prefix``."""

    uri: str = Field(default_factory=default_store_uri, description="Store root: a directory or s3://bucket/prefix.")
    endpoint_url: Optional[str] = Field(default=None, description="S3 endpoint (MinIO, moto, ...); None for AWS.")
    region_name: Optional[str] = Field(default=None, description="S3 region; None reads the environment.")

    def open(self) -> LocalStore | S3Store:
        if self.uri.startswith("s3://"):
            from dagster_aws.s3 import S3Resource

            client = S3Resource(endpoint_url=self.endpoint_url, region_name=self.region_name).get_client()
            return open_store(self.uri, s3_client=client)
        return open_store(self.uri)


class TargetModelResource(dg.ConfigurableResource):
    """The target LLM: weights, tokenizer, chat template and DFlash layer choice.

    Leave ``model_path`` unset for the embedded default (a tiny random-weight
    Qwen3 with the real Qwen3.6 tokenizer, built locally on first use). For a
    real target, point it at a local model directory (e.g. Qwen3.6-27B).
    """

    model_path: Optional[str] = Field(
        default_factory=lambda: os.environ.get("DFLASH_TARGET_MODEL") or None,
        description="Local model directory (default: $DFLASH_TARGET_MODEL); None = the embedded tiny target.",
    )
    tokenizer_path: Optional[str] = Field(default=None, description="Tokenizer directory; defaults to model_path.")
    chat_template_path: Optional[str] = Field(default=None, description="Jinja file replacing the target's template.")
    enable_thinking: bool = Field(default=True, description="Render prompts with thinking on (reasoning traces).")
    dtype: str = Field(default="auto", description="bfloat16 | float32 | auto (float32 for the tiny target).")
    target_layer_ids: Optional[list[int]] = Field(default=None, description="Explicit DFlash layers; always wins.")
    num_target_layers: int = Field(default=5, description="Layers picked by the DFlash rule when no list is given.")
    mask_token: str = Field(default="<|MASK|>", description="DFlash mask token in the tokenizer.")
    mask_token_id: Optional[int] = Field(default=None, description="Explicit mask token id; wins over the lookup.")

    def spec(self):
        from dflash_assets.target_model import TargetModelSpec, default_target_spec

        base = default_target_spec() if self.model_path is None else None
        dtype = self.dtype if self.dtype != "auto" else ("float32" if base is not None else "bfloat16")
        return TargetModelSpec(
            model_path=base.model_path if base is not None else self.model_path,
            tokenizer_path=self.tokenizer_path,
            chat_template_path=self.chat_template_path,
            chat_template_kwargs={"enable_thinking": self.enable_thinking},
            dtype=dtype,
            target_layer_ids=self.target_layer_ids,
            num_target_layers=self.num_target_layers,
            mask_token=self.mask_token,
            mask_token_id=self.mask_token_id,
        )


class EngineFleetResource(dg.ConfigurableResource):
    """The generation endpoints: SGLang hosts, one sglang-router URL, or OpenAI-compatible servers.

    Each endpoint is a URL, optionally prefixed by its kind (``sglang:``,
    ``openai:``, ``transformers:``); unprefixed URLs get ``default_kind``.
    Endpoints are probed at every materialization; one that serves another
    model than the target is refused, and with none serving it the run fails
    at once with the probe table. There is no silent fallback.
    """

    endpoints: list[str] = Field(
        default_factory=lambda: [u for u in os.environ.get("DFLASH_ENGINE_URLS", "").split(",") if u.strip()],
        description="Endpoint URLs (default: $DFLASH_ENGINE_URLS, comma-separated).",
    )
    default_kind: str = Field(default_factory=lambda: os.environ.get("DFLASH_ENGINE_KIND", "openai"),
                              description="sglang | openai | transformers, for URLs without a kind prefix.")
    max_concurrency: int = Field(default_factory=lambda: int(os.environ.get("DFLASH_ENGINE_CONCURRENCY", "32")),
                                 description="Requests in flight per endpoint.")
    served_model_name: Optional[str] = Field(default=None, description="Also accept endpoints serving this name.")
    request_timeout_s: float = Field(default=1800.0, description="Limit for one assistant turn.")
    max_retries: int = Field(default=4, description="Retries per request (408/429/5xx, connection errors).")

    def fleet_config(self, target_model: str):
        from dflash_assets.engine_fleet import EndpointConfig, EngineFleetConfig

        endpoints = []
        for entry in self.endpoints:
            kind, sep, url = entry.strip().partition(":")
            if not sep or kind not in ("sglang", "openai", "transformers"):
                kind, url = self.default_kind, entry.strip()
            endpoints.append(EndpointConfig(url=url, kind=kind, max_concurrency=self.max_concurrency))
        return EngineFleetConfig(
            endpoints=endpoints, target_model=target_model, served_model_name=self.served_model_name,
            request_timeout_s=self.request_timeout_s, max_retries=self.max_retries,
        )
