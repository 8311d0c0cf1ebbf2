"""The code location: every asset, check, resource, job and sensor of dflash-assets."""

from __future__ import annotations

import dagster as dg

from dagster_project.assets import prompts
from dagster_project.resources import StoreResource

defs = dg.Definitions(
    assets=dg.load_assets_from_modules([prompts]),
    resources={"store": StoreResource()},
)
