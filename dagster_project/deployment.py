"""Deployment profiles: one setting, ``DFLASH_PROFILE=local|cluster``, picks every resource.

The store, the target, the engine fleet and the GPU launcher all come from
here, built from the environment when the definitions load, and are bound
with ``deployment_resource``: a run cannot change them through run config
(its validation refuses any ``resources:`` config). ``SETTINGS`` lists every
variable, once; docs/deployment.md's table is checked against it (both live in
``profile.py``, which reads and parses the environment; this module builds
the resources from it, and reads no variable itself).

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

Reads: the settings ``profile.py`` parses from the environment. Writes nothing.
"""

from __future__ import annotations

import re
import shlex

import dagster as dg

from dagster_project.pipes import GpuHostLauncher
from dagster_project.profile import (DEFAULT_GPU_LAUNCH, DEFAULT_STAGE_TIMEOUT_S, PROFILE_ENV, REQUIRED, SETTINGS,
                                     DeploymentConfigError, Profile, allowed_prompt_sources, default_engine_kind,
                                     endpoint_kind_and_url, engine_kinds, env_flag, env_number, env_text, get_profile,
                                     missing_settings, require_settings, split_list, target_settings)
from dagster_project.resources import EngineFleetResource, StoreResource, TargetModelResource, deployment_resource

__all__ = [  # the profile's names are re-exported: callers import them from here as before
    "Profile",
    "PROFILE_ENV",
    "SETTINGS",
    "REQUIRED",
    "DEFAULT_GPU_LAUNCH",
    "DEFAULT_STAGE_TIMEOUT_S",
    "get_profile",
    "resources_for_profile",
    "store_for_profile",
    "target_for_profile",
    "engines_for_profile",
    "engine_kinds",
    "gpu_launcher_for_profile",
    "allowed_prompt_sources",
    "missing_settings",
    "DeploymentConfigError",
]


def store_for_profile(profile: Profile) -> StoreResource:
    if profile == "cluster":
        require_settings(profile)
        # boto3 reads AWS_ENDPOINT_URL / AWS_DEFAULT_REGION / credentials itself, on every host.
        return StoreResource(uri=env_text("DFLASH_STORE"))
    return StoreResource()  # $DFLASH_STORE, else $DAGSTER_HOME/dflash-store, else ./.dflash/store


def target_for_profile(profile: Profile) -> TargetModelResource:
    """The target: ``DFLASH_TARGET_MODEL`` (None: the embedded tiny target) and the ``DFLASH_TARGET_*`` settings."""
    return TargetModelResource(**target_settings())  # unset variables keep the resource's defaults, the library's


def engine_api_key() -> str | None:
    """The engines' bearer token: ``DFLASH_ENGINE_API_KEY``, else the file ``DFLASH_ENGINE_API_KEY_FILE`` names."""
    if key := env_text("DFLASH_ENGINE_API_KEY"):
        return key
    if path := env_text("DFLASH_ENGINE_API_KEY_FILE"):
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
    for i, entry in enumerate(split_list(env_text("DFLASH_ENGINE_API_KEYS")), 1):
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
        require_settings(profile)
    endpoints = split_list(env_text("DFLASH_ENGINE_URLS"))
    default_kind = default_engine_kind(profile)
    optional = {}  # unset variables keep the resource's defaults, which are the library's
    if env_text("DFLASH_ENGINE_CONCURRENCY"):
        optional["max_concurrency"] = int(env_number("DFLASH_ENGINE_CONCURRENCY", 0, int))
    if env_text("DFLASH_ENGINE_READ_TIMEOUT_S"):
        optional["read_timeout_s"] = env_number("DFLASH_ENGINE_READ_TIMEOUT_S", 0.0) or None  # 0: only the turn limit
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


def gpu_launcher_for_profile(profile: Profile) -> GpuHostLauncher:
    paths = {"scratch_dir": env_text("DFLASH_GPU_SCRATCH_DIR"),
             "work_dir": env_text("DFLASH_DRAFTER_WORK_DIR"),
             "timeout_s": env_number("DFLASH_GPU_STAGE_TIMEOUT_S", DEFAULT_STAGE_TIMEOUT_S)}
    if profile == "local":
        return GpuHostLauncher(**paths)  # a local subprocess of this interpreter
    require_settings(profile)
    prefix = shlex.split(env_text("DFLASH_GPU_LAUNCH") or DEFAULT_GPU_LAUNCH)
    env = dict(item.split("=", 1) for item in shlex.split(env_text("DFLASH_GPU_ENV") or "") if "=" in item)
    return GpuHostLauncher(
        command_prefix=prefix,
        hosts=split_list(env_text("DFLASH_GPU_HOSTS")),
        remote_shell=env_flag("DFLASH_GPU_REMOTE_SHELL", True),
        python=env_text("DFLASH_GPU_PYTHON") or "python3",
        workdir=env_text("DFLASH_GPU_WORKDIR"),
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
