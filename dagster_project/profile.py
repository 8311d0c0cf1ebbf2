"""The deployment profile and its settings: which profile runs, every environment variable a profile reads, parsed.

``DFLASH_PROFILE`` (``local`` or ``cluster``) and the ``DFLASH_*`` variables
listed once in ``SETTINGS`` (docs/deployment.md's table is checked against it). This
module only reads and parses them; ``deployment.py`` builds the resources
from what it returns, ``resources.py`` asks it which profile runs (whether a
step may start the embedded engine), ``config.py`` which prompt sources a run
may name, ``versions.py`` the target settings its code versions hash. It
imports nothing else of ``dagster_project``, so none of them import each
other in a circle.

Reads: environment variables only. Writes nothing.
"""

from __future__ import annotations

import os
from typing import Any, Literal, get_args

__all__ = [
    "Profile",
    "PROFILE_ENV",
    "SETTINGS",
    "REQUIRED",
    "DEFAULT_GPU_LAUNCH",
    "DEFAULT_STAGE_TIMEOUT_S",
    "DeploymentConfigError",
    "get_profile",
    "missing_settings",
    "require_settings",
    "split_list",
    "benchmark_prompt_files",
    "env_flag",
    "env_number",
    "env_text",
    "target_settings",
    "endpoint_kind_and_url",
    "default_engine_kind",
    "engine_kinds",
    "allowed_prompt_sources",
]

Profile = Literal["local", "cluster"]
PROFILE_ENV = "DFLASH_PROFILE"
DEFAULT_STAGE_TIMEOUT_S = 48 * 3600.0  # a GPU stage that runs longer is stopped: raise it for long trainings
DEFAULT_GPU_LAUNCH = "ssh -o BatchMode=yes -o ServerAliveInterval=30 -o ServerAliveCountMax=4 {host}"

# Every setting a profile reads, with what it is for (docs/deployment.md's table is checked against it).
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


def require_settings(profile: Profile) -> None:
    """Fail, naming each and what it is for, when a required setting of ``profile`` is unset."""
    if missing := missing_settings(profile):
        raise DeploymentConfigError(
            f"{PROFILE_ENV}={profile} needs {', '.join(missing)}: "
            + "; ".join(f"{name}: {SETTINGS[name]}" for name in missing)
        )


def split_list(value: str | None) -> list[str]:
    """A list setting: comma- or space-separated."""
    return [part for part in (value or "").replace(",", " ").split() if part]


def env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name, "").strip().lower()
    return default if not value else value not in ("0", "false", "no", "off")


def env_number(name: str, default: float, cast=float):
    value = os.environ.get(name, "").strip()
    try:
        return cast(value) if value else default
    except ValueError:
        raise DeploymentConfigError(f"{name}={value!r} is not a number: {SETTINGS[name]}") from None


def env_text(name: str) -> str | None:
    return os.environ.get(name, "").strip() or None


def benchmark_prompt_files() -> list[str]:
    """``DFLASH_BENCHMARK_PROMPTS``: the benchmark prompt files kept out of training data, separated by ``os.pathsep``."""
    return [p.strip() for p in (env_text("DFLASH_BENCHMARK_PROMPTS") or "").split(os.pathsep) if p.strip()]


def target_settings() -> dict[str, Any]:
    """``DFLASH_TARGET_MODEL`` (None: the embedded tiny target) and the ``DFLASH_TARGET_*`` settings, as the
    fields of ``TargetModelResource``; unset variables are left out, so the resource keeps the library's defaults."""
    layer_ids = env_text("DFLASH_TARGET_LAYER_IDS")
    mask_id = env_text("DFLASH_TARGET_MASK_TOKEN_ID")
    try:
        layers = [int(x) for x in split_list(layer_ids)] if layer_ids else None
        mask = int(mask_id) if mask_id else None
    except ValueError:
        raise DeploymentConfigError("DFLASH_TARGET_LAYER_IDS and DFLASH_TARGET_MASK_TOKEN_ID take integers "
                                    f"(got {layer_ids!r}, {mask_id!r})") from None
    optional = {"tokenizer_path": env_text("DFLASH_TARGET_TOKENIZER"),
                "chat_template_path": env_text("DFLASH_TARGET_CHAT_TEMPLATE"), "dtype": env_text("DFLASH_TARGET_DTYPE"),
                "mask_token": env_text("DFLASH_TARGET_MASK_TOKEN")}
    if env_text("DFLASH_TARGET_NUM_LAYERS"):
        optional["num_target_layers"] = int(env_number("DFLASH_TARGET_NUM_LAYERS", 0, int))
    return {"model_path": env_text("DFLASH_TARGET_MODEL"), "enable_thinking": env_flag("DFLASH_TARGET_THINKING", True),
            "target_layer_ids": layers, "mask_token_id": mask,
            **{k: v for k, v in optional.items() if v is not None}}


def endpoint_kind_and_url(entry: str, default_kind: str) -> tuple[str, str]:
    """``sglang:http://h:1`` -> ``("sglang", "http://h:1")``; an entry without a kind prefix gets ``default_kind``."""
    kind, sep, url = entry.strip().partition(":")
    if not sep or kind not in ("sglang", "openai", "transformers"):
        return default_kind, entry.strip()
    return kind, url


def default_engine_kind(profile: Profile) -> str:
    """The kind of a ``DFLASH_ENGINE_URLS`` entry without a prefix: ``DFLASH_ENGINE_KIND``, else sglang on the
    cluster and openai elsewhere."""
    return os.environ.get("DFLASH_ENGINE_KIND", "").strip() or ("sglang" if profile == "cluster" else "openai")


def engine_kinds() -> set[str]:
    """The engines the deployment generates with, as the ``completions`` asset's kinds in the UI: the kind of each
    ``DFLASH_ENGINE_URLS`` entry (``sglang``, ``openai``, ``transformers``), else ``transformers`` (the local
    profile's embedded ``transformers serve``, or the demo's in-process engine)."""
    default_kind = default_engine_kind(get_profile())
    return {endpoint_kind_and_url(e, default_kind)[0] for e in split_list(os.environ.get("DFLASH_ENGINE_URLS"))} \
        or {"transformers"}


def allowed_prompt_sources() -> list[str]:
    """What a run's ``source_uri`` may name: the configured source, the embedded file, ``DFLASH_PROMPT_SOURCE_ROOTS``."""
    from dflash_assets.prompts.sources import embedded_sharegpt_path

    configured = os.environ.get("DFLASH_PROMPT_SOURCE", "").strip()
    return [*([configured] if configured else []), str(embedded_sharegpt_path()),
            *split_list(os.environ.get("DFLASH_PROMPT_SOURCE_ROOTS"))]
