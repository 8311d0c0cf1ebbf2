"""Deployment profiles: one setting, ``DFLASH_PROFILE=local|cluster``, picks store, launchers and fleet.

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
returns the resources of one profile. Secrets stay in the environment: the
store URI is a ``dg.EnvVar``; credentials are read by boto3 on each host.
Settings that are lists (hosts, engine URLs) are read when definitions load,
and a cluster profile with one missing fails right there, naming it.

Reads: environment variables only. Writes nothing.
"""

from __future__ import annotations

import os
import shlex
from typing import Any, Literal, get_args

import dagster as dg

from dagster_project.pipes import GpuHostLauncher
from dagster_project.resources import StoreResource

__all__ = [
    "Profile",
    "PROFILE_ENV",
    "get_profile",
    "resources_for_profile",
    "store_for_profile",
    "gpu_launcher_for_profile",
    "fleet_settings",
    "missing_settings",
    "DeploymentConfigError",
]

Profile = Literal["local", "cluster"]
PROFILE_ENV = "DFLASH_PROFILE"
DEFAULT_GPU_LAUNCH = "ssh -o BatchMode=yes {host}"

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
    "DFLASH_GPU_ENV": "extra env for GPU stages, space-separated K=V (e.g. HF_HOME=/nvme/hf)",
    "DFLASH_ENGINE_URLS": "generation engines (or one sglang-router), comma-separated (required for cluster; "
                          "unset on local: each generating step starts transformers serve on the tiny target)",
    "DFLASH_ENGINE_KIND": "sglang (cluster default) or openai (local default), for URLs without a kind prefix",
    "DFLASH_ENGINE_CONCURRENCY": "requests in flight per engine (default 32)",
    "DFLASH_TARGET_MODEL": "the target model directory (default: the embedded tiny target); also read by `dflash engine`",
    "DFLASH_PROMPT_SOURCE": "prompt source the ingest and its sensor read (default: the embedded ShareGPT file)",
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


def store_for_profile(profile: Profile) -> StoreResource:
    if profile == "cluster":
        _require(profile)
        # boto3 reads AWS_ENDPOINT_URL / AWS_DEFAULT_REGION / credentials itself, on every host.
        return StoreResource(uri=dg.EnvVar("DFLASH_STORE"))
    return StoreResource()  # $DFLASH_STORE, else $DAGSTER_HOME/dflash-store, else ./.dflash/store


def gpu_launcher_for_profile(profile: Profile) -> GpuHostLauncher:
    if profile == "local":
        return GpuHostLauncher()  # a local subprocess of this interpreter
    _require(profile)
    prefix = shlex.split(os.environ.get("DFLASH_GPU_LAUNCH") or DEFAULT_GPU_LAUNCH)
    env = dict(item.split("=", 1) for item in shlex.split(os.environ.get("DFLASH_GPU_ENV", "")) if "=" in item)
    return GpuHostLauncher(
        command_prefix=prefix,
        hosts=_split(os.environ.get("DFLASH_GPU_HOSTS")),
        remote_shell=os.environ.get("DFLASH_GPU_REMOTE_SHELL", "1").strip() not in ("0", "false", "no"),
        python=os.environ.get("DFLASH_GPU_PYTHON") or "python3",
        workdir=os.environ.get("DFLASH_GPU_WORKDIR") or None,
        env=env,
    )


def fleet_settings(profile: Profile) -> dict[str, Any]:
    """Hook for the engine fleet: keyword arguments of ``dflash_assets.generation.fleet.EngineFleetConfig``.

    Holds ``endpoints`` only; the caller adds ``target_model`` (and an API key
    through ``dg.EnvVar``). ``local`` with no ``DFLASH_ENGINE_URLS`` returns no
    endpoints: there, ``EngineFleetResource`` starts the embedded engine for
    each step that generates on the tiny target.
    """
    if profile == "cluster":
        _require(profile)
    kind = os.environ.get("DFLASH_ENGINE_KIND", "sglang" if profile == "cluster" else "openai").strip()
    concurrency = int(os.environ.get("DFLASH_ENGINE_CONCURRENCY", "32"))
    urls = _split(os.environ.get("DFLASH_ENGINE_URLS"))
    return {"endpoints": [{"url": url, "kind": kind, "max_concurrency": concurrency} for url in urls]}


def resources_for_profile(profile: Profile | None = None) -> dict[str, Any]:
    """The resources of one profile: ``store`` and ``gpu_launcher`` (the fleet comes from ``fleet_settings``)."""
    profile = profile or get_profile()
    return {"store": store_for_profile(profile), "gpu_launcher": gpu_launcher_for_profile(profile)}
