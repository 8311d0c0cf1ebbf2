"""The code location: every asset, check, resource, job and sensor of dflash-assets.

``DFLASH_PROFILE`` (``local`` by default, or ``cluster``) picks every
resource: the store, the target, the engine fleet and the GPU launcher; see
``deployment.py``. On ``local`` with no ``DFLASH_ENGINE_URLS``, ``engines``
starts the embedded engine for each step that generates (see
``EngineFleetResource``). Run config cannot change a resource.

Reads, when it loads: the environment (``profile.py``) and, for the code versions, the target's files
(``versions.py``). Writes nothing.
"""

import dagster as dg

from dagster_project.assets import drafter, generation, hidden_states, prompts, tokenization
from dagster_project.deployment import get_profile, resources_for_profile
from dagster_project.jobs import ALL_JOBS, refresh_drafter_job
from dagster_project.sensors import prompt_source_sensor, target_refresh_sensor

PROFILE = get_profile()

defs = dg.Definitions(
    assets=dg.load_assets_from_modules([prompts, generation, tokenization, hidden_states, drafter]),
    resources=resources_for_profile(PROFILE),
    jobs=[*ALL_JOBS, refresh_drafter_job],
    sensors=[prompt_source_sensor, target_refresh_sensor],
)
