"""Code versions tied to the configuration that changes an asset's output.

Dagster marks a partition stale when its asset's code version changes. Each
stage's version is its logic version plus a hash of the defaults of its run
config and, for the stages that depend on the target, the target spec's
fingerprint (``TargetModelSpec.config_fingerprint``: model config, tokenizer,
chat template, thinking, layer ids, mask token, dtype) as the deployment
builds it from the environment (``profile.target_settings``). So changing a
default sampling parameter or pointing at another target, template or layer
choice marks every materialized partition stale in the UI. Per-run config
overrides are recorded in the data itself (``config_hash`` on every
completion row, the recipe fingerprint on every checkpoint).

Reads the environment (through ``profile``) and the target's config and
template files; writes nothing.
"""


import enum

import dagster as dg

from dflash_assets.cache_keys import content_key

from dagster_project.profile import target_settings
from dagster_project.resources import TargetModelResource


def _defaults(config_cls: type[dg.Config]) -> dict:
    """The defaults of the fields that can change the output (a field marked ``json_schema_extra={"output":
    False}``, such as how many processes share the work, does not mark partitions stale)."""
    return {name: repr(_plain(field.get_default(call_default_factory=True)))
            for name, field in sorted(config_cls.model_fields.items())
            if (field.json_schema_extra or {}).get("output", True)}


def _plain(value):
    """An enum choice hashes as its value, so a field that became an enum keeps its code version."""
    return value.value if isinstance(value, enum.Enum) else value


def target_fingerprint() -> str:
    """The fingerprint of the target the deployment runs (``DFLASH_TARGET_*``, else the embedded default)."""
    return TargetModelResource(**target_settings()).fingerprint()


def code_version(logic_version: str, *configs: type[dg.Config], target: bool = False) -> str:
    """``<logic_version>-<hash of config defaults (+ the target spec's fingerprint)>``."""
    payload = {c.__name__: _defaults(c) for c in configs}
    if target:
        payload["target"] = target_fingerprint()
    digest = content_key(payload, length=8)
    return f"{logic_version}-{digest}"
