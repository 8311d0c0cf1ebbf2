"""Deployment profiles: one setting, ``DFLASH_PROFILE=local|cluster``, picks every resource.

The store, the target, the engine fleet and the GPU launcher all come from
here, built from the environment when the definitions load, and are bound
with ``deployment_resource``: a run cannot change them through run config
(its validation refuses any ``resources:`` config). ``SETTINGS`` lists every
variable, once; the README's table is checked against it.

- ``local`` (the embedded default; no setting needed): a store directory
  under ``$DAGSTER_HOME`` (or ``$DFLASH_STORE``), GPU stages as local
  subprocesses, no engine configured: each step that generates starts its
  own ``transformers serve`` on the tiny target and stops it when it ends
  (``EngineFleetResource``, ``dflash_assets/embedded/engine.py``), SQLite
  instance (``deploy/local/dagster.yaml``). ``make ui`` runs ``dagster dev``
  through ``deploy/local/ui.py``, which stops all of it on Ctrl-C.
- ``cluster``: an ``s3://`` store (``DFLASH_STORE``; endpoint and
  credentials from ``AWS_*``, read by boto3, never by us), GPU stages on
  ``DFLASH_GPU_HOSTS`` through ``DFLASH_GPU_LAUNCH`` (default ssh), SGLang
  engines at ``DFLASH_ENGINE_URLS``, PostgreSQL instance
  (``deploy/cluster/dagster.yaml``, ``DAGSTER_PG_*``).

As in hooli's ``resource_def[get_env()]``: ``resources_for_profile(get_profile())``
returns the resources of one profile. Secrets stay in the environment:
credentials are read by boto3 on each host, engine API keys from
``DFLASH_ENGINE_API_KEY`` or the file ``DFLASH_ENGINE_API_KEY_FILE`` names,
and an endpoint's own key from the variable or file ``DFLASH_ENGINE_API_KEYS``
names for its URL (that setting holds names and paths, never a key).
Settings that are lists (hosts, engine URLs) are read when definitions load,
and a cluster profile with one missing fails right there, naming it.

Reads: environment variables only. Writes nothing.
"""

from __future__ import annotations

import os
import re
import shlex
from typing import Literal, get_args

import dagster as dg

from dagster_project.pipes import DEFAULT_STAGE_TIMEOUT_S, GpuHostLauncher
from dagster_project.resources import (EngineFleetResource, StoreResource, TargetModelResource, deployment_resource,
                                       endpoint_kind_and_url)

__all__ = [
    "Profile",
    "PROFILE_ENV",
    "get_profile",
    "resources_for_profile",
    "store_for_profile",
    "target_for_profile",
    "engines_for_profile",
    "gpu_launcher_for_profile",
    "allowed_prompt_sources",
    "missing_settings",
    "DeploymentConfigError",
]

Profile = Literal["local", "cluster"]
PROFILE_ENV = "DFLASH_PROFILE"
DEFAULT_GPU_LAUNCH = "ssh -o BatchMode=yes -o ServerAliveInterval=30 -o ServerAliveCountMax=4 {host}"

# Every setting a profile reads, with what it is for (the README table is built from this).
SETTINGS: dict[str, str] = {
    "DFLASH_PROFILE": "local (default) or cluster",
    "DFLASH_STORE": "store root: a directory, or s3://bucket/prefix (required for cluster)",
    "AWS_ENDPOINT_URL": "S3 endpoint for MinIO/moto/...; unset for AWS (read by boto3)",
    "DFLASH_GPU_HOSTS": "GPU hosts for Pipes stages, comma-separated (required for cluster)",
    "DFLASH_GPU_LAUNCH": f"launch prefix with {{host}}; default '{DEFAULT_GPU_LAUNCH}'",
    "DFLASH_GPU_REMOTE_SHELL": "1 (default): remote command as one shell string (ssh); 0: as argv (kubectl exec)",
    "DFLASH_GPU_PYTHON": "python on the GPU hosts (default python3)",
    "DFLASH_GPU_WORKDIR": "working directory on the GPU hosts",
    "DFLASH_GPU_ENV": "extra env for GPU stages, space-separated K=V (e.g. HF_HOME=/nvme/hf); sent over stdin",
    "DFLASH_GPU_STAGE_TIMEOUT_S": f"a GPU stage is stopped after this many seconds (default {DEFAULT_STAGE_TIMEOUT_S:.0f})",
    "DFLASH_GPU_SCRATCH_DIR": "fast local disk on the GPU hosts for staging cache parts (default: a temp dir)",
    "DFLASH_DRAFTER_WORK_DIR": "persistent dir on the GPU hosts for resumable training states (default: the cache)",
    "DFLASH_ENGINE_URLS": "generation engines (or one sglang-router), comma-separated (required for cluster; "
                          "unset on local: each generating step starts transformers serve on the tiny target)",
    "DFLASH_ENGINE_KIND": "sglang (cluster default) or openai (local default), for URLs without a kind prefix",
    "DFLASH_ENGINE_CONCURRENCY": "requests in flight per engine (default 32)",
    "DFLASH_ENGINE_READ_TIMEOUT_S": "an engine silent this long is cut off, plus 0.1 s per requested token "
                                    "(default 300; 0: only the 1,800 s turn limit)",
    "DFLASH_ENGINE_API_KEY": "bearer token sent to the engines (secret: never logged)",
    "DFLASH_ENGINE_API_KEY_FILE": "file holding that token, read when definitions load (instead of the variable)",
    "DFLASH_ENGINE_API_KEYS": "an endpoint's own token: comma-separated URL=VARIABLE or URL=/path/to/file, naming "
                              "where it is (never the token); endpoints not named get DFLASH_ENGINE_API_KEY[_FILE]",
    "DFLASH_TARGET_MODEL": "the target model directory (default: the embedded tiny target); also read by `dflash engine`",
    "DFLASH_TARGET_THINKING": "1 (default): render prompts with thinking on; 0: off",
    "DFLASH_TARGET_TOKENIZER": "another tokenizer directory (default: the model's)",
    "DFLASH_TARGET_CHAT_TEMPLATE": "a Jinja file replacing the target's chat template",
    "DFLASH_TARGET_DTYPE": "bfloat16 | float32 | auto (default: float32 for the tiny target, else bfloat16)",
    "DFLASH_TARGET_LAYER_IDS": "explicit DFlash layers, comma-separated (win over the rule)",
    "DFLASH_TARGET_NUM_LAYERS": "layers picked by the DFlash rule when no list is given (default 5)",
    "DFLASH_TARGET_MASK_TOKEN": "the DFlash mask token's name (default <|MASK|>, else the tokenizer's declared one)",
    "DFLASH_TARGET_MASK_TOKEN_ID": "an explicit mask token id (wins over the name; 248070 for published Qwen3.5/3.6 drafters)",
    "DFLASH_PROMPT_SOURCE": "prompt source the ingest and its sensor read (default: the embedded ShareGPT file)",
    "DFLASH_PROMPT_SOURCE_ROOTS": "other sources a run may ingest: comma-separated path or s3:// prefixes (default: none)",
    "DFLASH_BENCHMARK_PROMPTS": "benchmark prompt files kept out of training data by drafter_checkpoint's "
                                "decontamination check, separated by os.pathsep (default: none)",
    "DFLASH_CACHE": "local cache of built artifacts: tiny targets, tokenizer, drafter work dirs (default ~/.cache/dflash-assets)",
}
REQUIRED: dict[str, tuple[str, ...]] = {
    "local": (),
    "cluster": ("DFLASH_STORE", "DFLASH_GPU_HOSTS", "DFLASH_ENGINE_URLS"),
}


class DeploymentConfigError(ValueError):
    """A profile's settings are missing or invalid."""


def get_profile() -> Profile:
    """``$DFLASH_PROFILE`` (case-insensitive), ``local`` when unset or empty."""
    value = os.environ.get(PROFILE_ENV, "").strip().lower() or "local"
    if value not in get_args(Profile):
        raise DeploymentConfigError(f"{PROFILE_ENV}={value!r}: expected one of {list(get_args(Profile))}")
    return value  # type: ignore[return-value]


def missing_settings(profile: Profile) -> list[str]:
    return [name for name in REQUIRED[profile] if not os.environ.get(name, "").strip()]


def _require(profile: Profile) -> None:
    if missing := missing_settings(profile):
        raise DeploymentConfigError(
            f"{PROFILE_ENV}={profile} needs {', '.join(missing)}: "
            + "; ".join(f"{name}: {SETTINGS[name]}" for name in missing)
        )


def _split(value: str | None) -> list[str]:
    return [part for part in (value or "").replace(",", " ").split() if part]


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name, "").strip().lower()
    return default if not value else value not in ("0", "false", "no", "off")


def _number(name: str, default: float, cast=float):
    value = os.environ.get(name, "").strip()
    try:
        return cast(value) if value else default
    except ValueError:
        raise DeploymentConfigError(f"{name}={value!r} is not a number: {SETTINGS[name]}") from None


def store_for_profile(profile: Profile) -> StoreResource:
    if profile == "cluster":
        _require(profile)
        # boto3 reads AWS_ENDPOINT_URL / AWS_DEFAULT_REGION / credentials itself, on every host.
        return StoreResource(uri=os.environ["DFLASH_STORE"].strip())
    return StoreResource()  # $DFLASH_STORE, else $DAGSTER_HOME/dflash-store, else ./.dflash/store


def _text(name: str) -> str | None:
    return os.environ.get(name, "").strip() or None


def target_for_profile(profile: Profile) -> TargetModelResource:
    """The target: ``DFLASH_TARGET_MODEL`` (None: the embedded tiny target) and the ``DFLASH_TARGET_*`` settings."""
    layer_ids = _text("DFLASH_TARGET_LAYER_IDS")
    mask_id = _text("DFLASH_TARGET_MASK_TOKEN_ID")
    try:
        layers = [int(x) for x in _split(layer_ids)] if layer_ids else None
        mask = int(mask_id) if mask_id else None
    except ValueError:
        raise DeploymentConfigError("DFLASH_TARGET_LAYER_IDS and DFLASH_TARGET_MASK_TOKEN_ID take integers "
                                    f"(got {layer_ids!r}, {mask_id!r})") from None
    optional = {"tokenizer_path": _text("DFLASH_TARGET_TOKENIZER"),
                "chat_template_path": _text("DFLASH_TARGET_CHAT_TEMPLATE"), "dtype": _text("DFLASH_TARGET_DTYPE"),
                "mask_token": _text("DFLASH_TARGET_MASK_TOKEN")}
    if _text("DFLASH_TARGET_NUM_LAYERS"):
        optional["num_target_layers"] = int(_number("DFLASH_TARGET_NUM_LAYERS", 0, int))
    return TargetModelResource(  # unset variables keep the resource's defaults, which are the library's
        model_path=_text("DFLASH_TARGET_MODEL"), enable_thinking=_flag("DFLASH_TARGET_THINKING", True),
        target_layer_ids=layers, mask_token_id=mask,
        **{k: v for k, v in optional.items() if v is not None},
    )


def engine_api_key() -> str | None:
    """The engines' bearer token: ``DFLASH_ENGINE_API_KEY``, else the file ``DFLASH_ENGINE_API_KEY_FILE`` names."""
    if key := os.environ.get("DFLASH_ENGINE_API_KEY", "").strip():
        return key
    if path := os.environ.get("DFLASH_ENGINE_API_KEY_FILE", "").strip():
        try:
            return open(path, encoding="utf-8").read().strip() or None
        except OSError as e:
            raise DeploymentConfigError(f"DFLASH_ENGINE_API_KEY_FILE: cannot read {path!r} ({e.strerror})") from None
    return None


_VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def engine_api_key_sources(endpoints: list[str], default_kind: str) -> dict[str, str]:
    """``DFLASH_ENGINE_API_KEYS``: endpoint URL -> the variable name or absolute file path holding its token.

    Each entry is ``URL=VARIABLE`` or ``URL=/path/to/file`` (comma- or space-separated; the URL as in
    ``DFLASH_ENGINE_URLS``, kind prefix optional). A URL that is no configured endpoint, or a right-hand side
    that is neither a variable name nor an absolute path (a token pasted in by mistake), is an error that
    quotes neither side's value beyond the URL.
    """
    urls = {endpoint_kind_and_url(e, default_kind)[1].rstrip("/") for e in endpoints}
    sources: dict[str, str] = {}
    for i, entry in enumerate(_split(os.environ.get("DFLASH_ENGINE_API_KEYS")), 1):
        endpoint, sep, source = entry.partition("=")
        url = endpoint_kind_and_url(endpoint, default_kind)[1].rstrip("/")
        if not sep or not url:
            raise DeploymentConfigError(f"DFLASH_ENGINE_API_KEYS: entry {i} is not URL=VARIABLE or URL=/path/to/file")
        if url not in urls:
            raise DeploymentConfigError(f"DFLASH_ENGINE_API_KEYS names {url}, which is not in DFLASH_ENGINE_URLS")
        if not (source.startswith("/") or _VARIABLE_NAME.fullmatch(source)):
            raise DeploymentConfigError(f"DFLASH_ENGINE_API_KEYS: the entry for {url} must name an environment "
                                        "variable or an absolute file path holding the token, not the token itself")
        sources[url] = source
    return sources


def engines_for_profile(profile: Profile) -> EngineFleetResource:
    """``DFLASH_ENGINE_URLS`` with their kind, concurrency and keys; none on local: the embedded engine per step.

    Every key is checked here (a variable unset, a file missing or empty fails now, naming the endpoint and the
    variable or file); the fleet reads an endpoint's own key again from its variable or file when a step builds it.
    """
    if profile == "cluster":
        _require(profile)
    endpoints = _split(os.environ.get("DFLASH_ENGINE_URLS"))
    default_kind = _default_engine_kind(profile)
    optional = {}  # unset variables keep the resource's defaults, which are the library's
    if _text("DFLASH_ENGINE_CONCURRENCY"):
        optional["max_concurrency"] = int(_number("DFLASH_ENGINE_CONCURRENCY", 0, int))
    if _text("DFLASH_ENGINE_READ_TIMEOUT_S"):
        optional["read_timeout_s"] = _number("DFLASH_ENGINE_READ_TIMEOUT_S", 0.0) or None  # 0: only the turn limit
    engines = EngineFleetResource(
        endpoints=endpoints,
        default_kind=default_kind,
        api_key=engine_api_key(),
        api_key_sources=engine_api_key_sources(endpoints, default_kind),
        **optional,
    )
    if engines.api_key_sources:
        from dflash_assets.generation.fleet import endpoint_api_key

        fleet = engines.fleet_config(target_model="-")
        for ep in fleet.endpoints:
            try:
                endpoint_api_key(ep, fleet)
            except ValueError as e:
                raise DeploymentConfigError(f"DFLASH_ENGINE_API_KEYS: {e}") from None
    return engines


def engine_kinds() -> set[str]:
    """The engines the deployment generates with, as the ``completions`` asset's kinds in the UI: the kind of each
    ``DFLASH_ENGINE_URLS`` entry (``sglang``, ``openai``, ``transformers``), else ``transformers`` (the local
    profile's embedded ``transformers serve``, or the demo's in-process engine)."""
    default_kind = _default_engine_kind(get_profile())
    return {endpoint_kind_and_url(e, default_kind)[0] for e in _split(os.environ.get("DFLASH_ENGINE_URLS"))} \
        or {"transformers"}


def _default_engine_kind(profile: Profile) -> str:
    """The kind of a ``DFLASH_ENGINE_URLS`` entry without a prefix: ``DFLASH_ENGINE_KIND``, else sglang on the
    cluster and openai elsewhere."""
    return os.environ.get("DFLASH_ENGINE_KIND", "").strip() or ("sglang" if profile == "cluster" else "openai")


def allowed_prompt_sources() -> list[str]:
    """What a run's ``source_uri`` may name: the configured source, the embedded file, ``DFLASH_PROMPT_SOURCE_ROOTS``."""
    from dflash_assets.prompts.sources import embedded_sharegpt_path

    configured = os.environ.get("DFLASH_PROMPT_SOURCE", "").strip()
    return [*([configured] if configured else []), str(embedded_sharegpt_path()),
            *_split(os.environ.get("DFLASH_PROMPT_SOURCE_ROOTS"))]


def gpu_launcher_for_profile(profile: Profile) -> GpuHostLauncher:
    paths = {"scratch_dir": os.environ.get("DFLASH_GPU_SCRATCH_DIR", "").strip() or None,
             "work_dir": os.environ.get("DFLASH_DRAFTER_WORK_DIR", "").strip() or None,
             "timeout_s": _number("DFLASH_GPU_STAGE_TIMEOUT_S", DEFAULT_STAGE_TIMEOUT_S)}
    if profile == "local":
        return GpuHostLauncher(**paths)  # a local subprocess of this interpreter
    _require(profile)
    prefix = shlex.split(os.environ.get("DFLASH_GPU_LAUNCH") or DEFAULT_GPU_LAUNCH)
    env = dict(item.split("=", 1) for item in shlex.split(os.environ.get("DFLASH_GPU_ENV", "")) if "=" in item)
    return GpuHostLauncher(
        command_prefix=prefix,
        hosts=_split(os.environ.get("DFLASH_GPU_HOSTS")),
        remote_shell=_flag("DFLASH_GPU_REMOTE_SHELL", True),
        python=os.environ.get("DFLASH_GPU_PYTHON") or "python3",
        workdir=os.environ.get("DFLASH_GPU_WORKDIR") or None,
        env=env,
        **paths,
    )


def resources_for_profile(profile: Profile | None = None) -> dict[str, dg.ResourceDefinition]:
    """Every resource of one profile (store, target, engines, gpu_launcher), none settable by run config."""
    profile = profile or get_profile()
    return {
        "store": deployment_resource(store_for_profile(profile)),
        "target": deployment_resource(target_for_profile(profile)),
        "engines": deployment_resource(engines_for_profile(profile)),
        "gpu_launcher": deployment_resource(gpu_launcher_for_profile(profile)),
    }
