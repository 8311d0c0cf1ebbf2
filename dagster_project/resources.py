"""Deployment resources: the store, the target model, the engine fleet (and, in ``pipes.py``, the GPU launcher).

These are deployment settings: the profile builds them from the environment
(``deployment.py``) and ``deployment_resource`` binds them with an empty
config schema, so a run that tries to set one from run config (the
launchpad) fails validation before anything starts. What a run may choose
(sampling, recipes, partitions) lives in ``config.py``.

The store is addressed by one URI (a local directory by default, or
``s3://bucket/prefix``); S3 clients come from dagster-aws's ``S3Resource``,
with credentials from the environment (never logged).

The engine fleet lists the generation endpoints. On the local profile with
none configured and the embedded tiny target, the step that asks for the
fleet starts its own ``transformers serve`` (``EmbeddedEngine``) and the
resource stops it when the step ends; anywhere else an empty fleet fails the
step at once, saying how to start an engine.

Reads: nothing by itself (``deployment.py`` builds these from the environment;
``profile.get_profile`` says whether a step may start the embedded engine).
Writes nothing; the embedded engine writes its log to a temporary file.
"""

from typing import Any, Optional

import dagster as dg
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr

from dagster_project.profile import endpoint_kind_and_url, get_profile
from dflash_assets.generation.fleet import EndpointConfig, EngineFleetConfig
from dflash_assets.store.backends import LocalStore, S3Store, default_store_uri, open_store
from dflash_assets.target_model.conventions import DEFAULT_NUM_TARGET_LAYERS, MASK_TOKEN

__all__ = [
    "DeploymentResource",
    "deployment_resource",
    "StoreResource",
    "TargetModelResource",
    "EngineFleetResource",
    "endpoint_kind_and_url",
    "no_engine_message",
]


EMBEDDED_TARGET = "embedded:tiny-dense"  # the embedded default's name in code versions (not built to name it)


def _default(model: type[BaseModel], field: str) -> Any:
    """The library's default for ``model.field``: resources repeat no default of their own."""
    return model.model_fields[field].default


class DeploymentResource(BaseModel):
    """A resource whose settings come from the deployment profile, never from a run (frozen once built)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    def for_step(self, log: Any = None) -> "DeploymentResource":
        """The object one step uses; resources with per-step state return a fresh copy."""
        return self

    def close(self) -> None:
        """Release what ``for_step`` started (nothing by default)."""


def deployment_resource(value: DeploymentResource) -> dg.ResourceDefinition:
    """``value`` as a Dagster resource that run config cannot change.

    The config schema is empty, so ``resources: {name: {config: {...}}}`` in a
    run's config is refused by Dagster's validation ("unexpected config
    entry") before the run starts: launcher commands, store addresses, engine
    URLs and target paths are set where the deployment is, not per run.
    """
    if not isinstance(value, DeploymentResource):
        raise TypeError(f"expected a DeploymentResource, got {type(value).__name__}")

    def _init(context: dg.InitResourceContext):
        step = value.for_step(log=context.log)
        try:
            yield step
        finally:
            step.close()

    doc = (type(value).__doc__ or type(value).__name__).strip().splitlines()[0]
    return dg.ResourceDefinition(
        resource_fn=_init, config_schema={},
        description=f"{doc} Deployment setting: set by DFLASH_PROFILE and the environment, not by run config.",
    )


class StoreResource(DeploymentResource):
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


class TargetModelResource(DeploymentResource):
    """The target LLM: weights, tokenizer, chat template and DFlash layer choice.

    Leave ``model_path`` unset for the embedded default (a tiny random-weight
    Qwen3 with the real Qwen3.6 tokenizer, built locally on first use). For a
    real target, point it at a local model directory (e.g. Qwen3.6-27B).
    """

    model_path: Optional[str] = Field(default=None, description="Local model directory; None = the embedded tiny target.")
    tokenizer_path: Optional[str] = Field(default=None, description="Tokenizer directory; defaults to model_path.")
    chat_template_path: Optional[str] = Field(default=None, description="Jinja file replacing the target's template.")
    enable_thinking: bool = Field(default=True, description="Render prompts with thinking on (reasoning traces).")
    dtype: str = Field(default="auto", description="bfloat16 | float32 | auto (float32 for the tiny target).")
    target_layer_ids: Optional[list[int]] = Field(default=None, description="Explicit DFlash layers; always wins.")
    num_target_layers: int = Field(default=DEFAULT_NUM_TARGET_LAYERS,
                                   description="Layers picked by the DFlash rule when no list is given.")
    mask_token: str = Field(default=MASK_TOKEN, description="DFlash mask token in the tokenizer.")
    mask_token_id: Optional[int] = Field(default=None, description="Explicit mask token id; wins over the lookup.")

    def spec(self):
        """The library's ``TargetModelSpec`` of this target (the embedded default is built on first use)."""
        from dflash_assets.embedded.defaults import default_target_spec

        base = default_target_spec() if self.model_path is None else None
        return self._spec(base.model_path if base is not None else self.model_path, embedded=base is not None)

    def fingerprint(self) -> str:
        """The spec's ``config_fingerprint`` (model config, tokenizer path, template, thinking, layers, dtype, mask):
        what the assets' code versions hash. The embedded default is not built for it: it stands as
        ``EMBEDDED_TARGET`` with its settings."""
        if self.model_path is None:
            return self._spec(EMBEDDED_TARGET, embedded=True).config_fingerprint()
        return self.spec().config_fingerprint()

    def _spec(self, model_path: str, embedded: bool):
        from dflash_assets.target_model.spec import TargetModelSpec

        dtype = self.dtype if self.dtype != "auto" else ("float32" if embedded else "bfloat16")
        return TargetModelSpec(
            model_path=model_path,
            tokenizer_path=self.tokenizer_path,
            chat_template_path=self.chat_template_path,
            chat_template_kwargs={"enable_thinking": self.enable_thinking},
            dtype=dtype,
            target_layer_ids=self.target_layer_ids,
            num_target_layers=self.num_target_layers,
            mask_token=self.mask_token,
            mask_token_id=self.mask_token_id,
        )


class EngineFleetResource(DeploymentResource):
    """The generation endpoints: SGLang hosts, one sglang-router URL, or OpenAI-compatible servers.

    Each endpoint is a URL, optionally prefixed by its kind (``sglang:``,
    ``openai:``, ``transformers:``); unprefixed URLs get ``default_kind``.
    Endpoints are probed at every materialization; one that serves another
    model than the target is refused, and with none serving it the run fails
    at once with the probe table. There is no silent fallback.

    With no endpoints, on the local profile (``DFLASH_PROFILE`` unset or
    ``local``) and the embedded tiny target, ``fleet_config`` starts the
    embedded engine for this step (``transformers serve`` on 127.0.0.1, a
    free port) and ``close`` stops it when the step ends. Whether that may
    happen is read from the environment, never from run config.
    """

    endpoints: list[str] = Field(default_factory=list, description="Endpoint URLs, optionally kind-prefixed.")
    default_kind: str = Field(default="openai", description="sglang | openai | transformers, for URLs without a prefix.")
    # Defaults are the library's own (EndpointConfig / EngineFleetConfig), written once there.
    max_concurrency: int = Field(default=_default(EndpointConfig, "max_concurrency"), ge=1,
                                 description="Requests in flight per endpoint.")
    served_model_name: Optional[str] = Field(default=None, description="Also accept endpoints serving this name.")
    request_timeout_s: float = Field(default=_default(EngineFleetConfig, "request_timeout_s"),
                                     description="Limit for one assistant turn.")
    read_timeout_s: Optional[float] = Field(default=_default(EngineFleetConfig, "read_timeout_s"),
                                            description="An engine silent this long is cut off (plus "
                                            "read_timeout_per_token_s per requested token); None: only the turn limit.")
    max_retries: int = Field(default=_default(EngineFleetConfig, "max_retries"),
                             description="Retries per request (408/429/5xx, connection errors).")
    api_key: Optional[SecretStr] = Field(default=None, description="Bearer token for the engines (masked in repr).")
    api_key_sources: dict[str, str] = Field(
        default_factory=dict, description="Endpoint URL -> where its own token is: the name of an environment "
        "variable, or an absolute file path (never the token itself); endpoints not named get api_key.")

    _embedded: Optional[object] = PrivateAttr(default=None)  # EmbeddedEngine, once a step asked for it
    _log: Optional[object] = PrivateAttr(default=None)

    def for_step(self, log: Any = None) -> "EngineFleetResource":
        step = self.model_copy()
        step._embedded, step._log = None, log
        return step

    def close(self) -> None:
        if self._embedded is not None:
            self._embedded.stop()
            self._embedded = None

    def fleet_config(self, target_model: str):
        endpoints = []
        sources = {url.rstrip("/"): src for url, src in self.api_key_sources.items()}
        for entry in self.endpoints:
            kind, url = endpoint_kind_and_url(entry, self.default_kind)
            src = sources.get(url.rstrip("/"))
            key = ({} if src is None else {"api_key_file": src} if src.startswith("/") else {"api_key_env": src})
            endpoints.append(EndpointConfig(url=url, kind=kind, max_concurrency=self.max_concurrency, **key))
        if not endpoints:
            endpoints = [self._embedded_endpoint(target_model)]
        return EngineFleetConfig(
            endpoints=endpoints, target_model=target_model, served_model_name=self.served_model_name,
            request_timeout_s=self.request_timeout_s, read_timeout_s=self.read_timeout_s,
            max_retries=self.max_retries, api_key=self.api_key,
        )

    def _embedded_endpoint(self, target_model: str):
        """The embedded engine's endpoint, started now if needed; a non-retryable failure where none may start."""
        from dflash_assets.embedded.engine import EmbeddedEngine, is_embedded_target

        profile = get_profile()
        if profile != "local" or not is_embedded_target(target_model):
            raise dg.Failure(description=no_engine_message(profile, target_model), allow_retries=False)
        if self._embedded is None:
            self._embedded = EmbeddedEngine(log=self._log.info if self._log is not None else None)
        return self._embedded.endpoint()


def no_engine_message(profile: str, target_model: str) -> str:
    """What to do when no generation engine is configured for ``target_model``."""
    return (
        f"No generation engine is configured for the target {target_model!r} (DFLASH_PROFILE={profile}, "
        "DFLASH_ENGINE_URLS is empty). Start one where the GPUs are and point the fleet at it:\n"
        f"  dflash engine --start --target {target_model} --port 30000   "
        "# SGLang; pip install 'dflash-assets[sglang]' on the GPU host first\n"
        "  export DFLASH_ENGINE_URLS=sglang:http://<gpu-host>:30000   "
        "# several: comma-separated; or one sglang-router URL\n"
        "then restart `make ui` / the code location so the definitions read it. `dflash engine` without "
        "--start prints the command. Only the local profile with the embedded tiny target starts an engine "
        "(transformers serve) by itself."
    )


# What an asset's parameter is annotated with: the resource, bound by ``deployment_resource``.
StoreParam = dg.ResourceParam[StoreResource]
TargetParam = dg.ResourceParam[TargetModelResource]
EnginesParam = dg.ResourceParam[EngineFleetResource]
