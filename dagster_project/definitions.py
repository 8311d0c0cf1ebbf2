"""The code location: every asset, check, resource, job and sensor of dflash-assets.

``DFLASH_PROFILE`` (``local`` by default, or ``cluster``) picks the store,
the GPU launcher and the engine fleet; see ``deployment.py``. On ``local``
with no ``DFLASH_ENGINE_URLS``, ``engines`` starts the embedded engine for
each step that generates (see ``EngineFleetResource``).
"""

import os

import dagster as dg

from dagster_project.assets import drafter, generation, hidden_states, prompts, tokenization
from dagster_project.deployment import get_profile, resources_for_profile
from dagster_project.jobs import ALL_JOBS
from dagster_project.resources import EngineFleetResource, TargetModelResource
from dagster_project.sensors import prompt_source_sensor

PROFILE = get_profile()

defs = dg.Definitions(
    assets=dg.load_assets_from_modules([prompts, generation, tokenization, hidden_states, drafter]),
    resources={
        **resources_for_profile(PROFILE),
        "target": TargetModelResource(),
        "engines": EngineFleetResource(
            default_kind=os.environ.get("DFLASH_ENGINE_KIND", "sglang" if PROFILE == "cluster" else "openai")
        ),
    },
    jobs=ALL_JOBS,
    sensors=[prompt_source_sensor],
)
