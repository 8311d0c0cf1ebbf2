"""Code versions tied to the configuration that changes an asset's output.

Dagster marks a partition stale when its asset's code version changes. Each
stage's version is its logic version plus a hash of the defaults of its run
config and of the deployment settings it depends on (the target, its chat
template, its layer ids), so changing a default sampling parameter or
pointing at another target marks every materialized partition stale in the
UI. Per-run config overrides are recorded in the data itself (``config_hash``
on every completion row, the recipe fingerprint on every checkpoint).
"""

import hashlib
import json
import os

import dagster as dg

TARGET_SETTINGS = ("DFLASH_TARGET_MODEL", "DFLASH_TARGET_TOKENIZER", "DFLASH_TARGET_CHAT_TEMPLATE",
                   "DFLASH_TARGET_THINKING", "DFLASH_TARGET_DTYPE", "DFLASH_TARGET_LAYER_IDS",
                   "DFLASH_TARGET_NUM_LAYERS", "DFLASH_TARGET_MASK_TOKEN", "DFLASH_TARGET_MASK_TOKEN_ID")


def _defaults(config_cls: type[dg.Config]) -> dict:
    return {name: repr(field.get_default(call_default_factory=True))
            for name, field in sorted(config_cls.model_fields.items())}


def code_version(logic_version: str, *configs: type[dg.Config], target: bool = False) -> str:
    """``<logic_version>-<hash of config defaults (+ target settings)>``."""
    payload = {c.__name__: _defaults(c) for c in configs}
    if target:
        from dagster_project.resources import TargetModelResource

        payload["target"] = {k: os.environ.get(k) for k in TARGET_SETTINGS}
        payload["target_defaults"] = _defaults(TargetModelResource)
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:8]
    return f"{logic_version}-{digest}"
