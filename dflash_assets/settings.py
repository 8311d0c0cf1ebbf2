"""The library's settings from the environment: every variable the library reads for itself, read here only.

``DFLASH_CACHE`` (the cache root), ``DFLASH_STORE`` and ``DAGSTER_HOME`` (the default store),
``AWS_ENDPOINT_URL`` (an S3-compatible endpoint), ``DFLASH_TARGET_MODEL`` (the target the command line serves).
The Dagster layer's deployment settings are read by ``dagster_project/profile.py``; variables that other tools set
for a process (torchrun's ``WORLD_SIZE`` and ``LOCAL_RANK``, ``OMP_NUM_THREADS``, oneDNN's ISA cap) are read where
they apply, and an endpoint's API key by the name its configuration gives.

Reads environment variables only. Writes nothing. Imports the standard library only.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_root", "store_uri", "s3_endpoint_url", "target_model", "legacy_target_only", "LEGACY_TARGET_ENV"]

# A name some deployments set for the target; the library reads DFLASH_TARGET_MODEL only, and says so.
LEGACY_TARGET_ENV = "DFLASH_TARGET"


def _value(name: str) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or None


def cache_root() -> Path:
    """Cache root shared by dflash-assets: ``$DFLASH_CACHE``, else ``~/.cache/dflash-assets``."""
    env = _value("DFLASH_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dflash-assets"


def store_uri() -> str:
    """The default store: ``$DFLASH_STORE``, else ``$DAGSTER_HOME/dflash-store``, else ``./.dflash/store``."""
    if uri := _value("DFLASH_STORE"):
        return uri
    if home := _value("DAGSTER_HOME"):
        return str(Path(home) / "dflash-store")
    return str(Path(".dflash/store").resolve())


def s3_endpoint_url() -> str | None:
    """``$AWS_ENDPOINT_URL`` (moto, MinIO, another S3-compatible store), else None: AWS itself."""
    return _value("AWS_ENDPOINT_URL")


def target_model() -> str | None:
    """``$DFLASH_TARGET_MODEL``: the target's model directory or name, else None."""
    return _value("DFLASH_TARGET_MODEL")


def legacy_target_only() -> bool:
    """True when ``DFLASH_TARGET`` is set but ``DFLASH_TARGET_MODEL`` is not: a setting that would be ignored."""
    return _value(LEGACY_TARGET_ENV) is not None and target_model() is None
