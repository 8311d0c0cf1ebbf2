"""A refresh when the target changes: what is stale, what to run next, which recipe retrains.

The policy behind ``target_refresh_sensor`` (``dagster_project/sensors.py``), on plain values so it needs no
Dagster: the sensor reads the instance (the code version and time of each shard's latest materialization, the
assets' current code versions, the family's promoted manifest and registered recipes) and turns the
``RefreshPlan`` into run requests.

The order, per tick:

1. Per prompt shard, the chain ``completions`` -> ``tokenized_samples`` -> ``hidden_state_cache``: an asset is
   to redo when its latest materialization's code version is not the current one (the target's fingerprint is
   in it) or something before it in the chain is to redo or was materialized after it. A shard with work gets
   one run of the stage of its first asset to redo: ``prepare`` (``prepare_data_job``, completions and
   tokenized samples) or ``hidden_states`` (``hidden_state_cache``); the next stage follows on a later tick.
   Shards never materialized are not touched.
2. Per drafter family with a promoted drafter: when every shard the promoted recipe trained on is fresh, the
   family's next recipe (``<family>-v<N+1>``: the promoted recipe with ``init_from: "promoted"``, same shards)
   is registered, and on the next tick (its partition exists by then) trained (``refresh_drafter_job``): warm start from the promoted weights when the shapes
   match, and the ``promotion`` check compares old and new tau on the same held-out prompts. A family already
   has its refresh when one of its recipes has ``drafter_eval`` at the current code version.
3. Done when no shard has work and every family has its refresh.

Reads and writes nothing: the sensor passes the store's readers to ``family_states``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SHARD_CHAIN", "STAGE_OF", "ShardRun", "FamilyState", "RefreshPlan", "shard_work", "next_recipe",
           "family_states", "plan_refresh"]

SHARD_CHAIN = ("completions", "tokenized_samples", "hidden_state_cache")
STAGE_OF = {"completions": "prepare", "tokenized_samples": "prepare", "hidden_state_cache": "hidden_states"}
DRAFTER_ASSETS = ("drafter_checkpoint", "drafter_eval")

# asset -> shard -> (code version of the latest materialization, its timestamp)
Materialized = Mapping[str, Mapping[str, tuple[str | None, float]]]


@dataclass(frozen=True)
class ShardRun:
    """One run to request: ``stage`` ("prepare" or "hidden_states") of ``shard``, for ``assets``."""

    shard: str
    stage: str
    assets: tuple[str, ...]


@dataclass(frozen=True)
class FamilyState:
    """A drafter family as the instance and store show it.

    ``promoted_recipe``: the recipe (its dict) the promoted manifest names; ``recipes``: every registered recipe
    name; ``drafter_versions``: recipe -> asset -> code version of its latest materialization (drafter assets);
    ``refresh_recipe``: the recipe this refresh registered already (the sensor's cursor), if any."""

    family: str
    promoted_recipe: Mapping[str, Any]
    recipes: tuple[str, ...] = ()
    drafter_versions: Mapping[str, Mapping[str, str | None]] = field(default_factory=dict)
    refresh_recipe: str | None = None


@dataclass
class RefreshPlan:
    shard_runs: list[ShardRun] = field(default_factory=list)
    register: list[dict[str, Any]] = field(default_factory=list)  # recipe dicts to save and add as partitions
    train: list[str] = field(default_factory=list)  # recipes to run refresh_drafter_job for
    refreshed: dict[str, str] = field(default_factory=dict)  # family -> its recipe at the current code version
    waiting: list[str] = field(default_factory=list)  # what the refresh waits for, in words

    @property
    def done(self) -> bool:
        return not (self.shard_runs or self.register or self.train or self.waiting)

    def lines(self) -> list[str]:
        """What the plan does and waits for, one line each (the sensor logs them)."""
        out = [f"{r.shard}: {r.stage} ({', '.join(r.assets)})" for r in self.shard_runs]
        out += [f"register recipe {r['name']} (init_from promoted, shards {list(r.get('partitions') or [])})"
                for r in self.register]
        out += [f"train {name} (refresh_drafter_job)" for name in self.train]
        out += [f"{family}: refreshed by {name}" for family, name in sorted(self.refreshed.items())]
        return out + [f"waiting: {w}" for w in self.waiting]


def shard_work(current: Mapping[str, str], materialized: Materialized) -> dict[str, list[str]]:
    """Shard -> the chain's assets to redo, in chain order (see the module docstring); shards with none left out.

    ``current``: asset -> its current code version."""
    shards = sorted({s for asset in SHARD_CHAIN for s in materialized.get(asset, {})})
    work: dict[str, list[str]] = {}
    for shard in shards:
        redo: list[str] = []
        upstream_redo, upstream_time = False, None
        for asset in SHARD_CHAIN:
            seen = materialized.get(asset, {}).get(shard)
            if seen is None:  # never materialized here (a failed check, a shard not run so far): nothing to redo
                if upstream_redo:
                    redo.append(asset)
                upstream_time = None
                continue
            version, when = seen
            if upstream_redo or version != current.get(asset) or (upstream_time is not None and upstream_time > when):
                redo.append(asset)
                upstream_redo = True
            upstream_time = when
        if redo:
            work[shard] = redo
    return work


def next_recipe(promoted: Mapping[str, Any], family: str, names: Iterable[str]) -> dict[str, Any]:
    """The family's next recipe: the promoted one named ``<family>-v<N+1>`` (N: the highest version among
    ``names`` of that family), with ``init_from: "promoted"``."""
    pattern = re.compile(rf"^{re.escape(family)}-v(\d+)$")
    versions = [int(m.group(1)) for m in map(pattern.match, [*names, promoted["name"]]) if m]
    recipe = dict(promoted)
    recipe["name"] = f"{family}-v{max(versions, default=1) + 1}"
    recipe["init_from"] = "promoted"
    if recipe.get("family") is None and re.sub(r"-v\d+$", "", recipe["name"]) != family:
        recipe["family"] = family
    return recipe


def family_states(recipe_names: Iterable[str], load_recipe: Callable[[str], Any],
                  read_promoted: Callable[[str], Mapping[str, Any] | None], materialized: Materialized,
                  drafter: Materialized, registered: Mapping[str, str],
                  warn: Callable[[str], None]) -> tuple[list[FamilyState], dict[str, list[str]]]:
    """The refresh's view of each drafter family with a promoted drafter, and the shards each family's promoted
    recipe trained on when it names none (every shard of ``hidden_state_cache``).

    ``recipe_names``: the registered recipes; ``load_recipe(name)``: a recipe (``family_name``, ``to_dict()``);
    ``read_promoted(family)``: the family's promoted manifest or None; ``drafter``: the drafter assets'
    latest materializations by recipe; ``registered``: family -> the recipe this refresh registered already. A
    recipe that cannot be read is reported through ``warn`` and left out; a family with no promoted drafter too."""
    families: dict[str, list[str]] = {}
    for name in sorted(recipe_names):
        try:
            families.setdefault(load_recipe(name).family_name, []).append(name)
        except (FileNotFoundError, ValueError, TypeError) as e:
            warn(f"recipe {name}: cannot read it ({e}); left out of the refresh")
    states, trained = [], {}
    for family, recipes in sorted(families.items()):
        promoted = read_promoted(family)
        if promoted is None:
            continue
        promoted_recipe = load_recipe(promoted["recipe"]).to_dict()
        if not promoted_recipe.get("partitions"):
            trained[family] = sorted(materialized.get("hidden_state_cache", {}))
        versions = {r: {a: drafter[a][r][0] for a in DRAFTER_ASSETS if r in drafter.get(a, {})} for r in recipes}
        states.append(FamilyState(family, promoted_recipe, tuple(recipes), versions, registered.get(family)))
    return states, trained


def plan_refresh(current: Mapping[str, str], materialized: Materialized, families: Iterable[FamilyState],
                 trained_shards: Mapping[str, Iterable[str]] | None = None) -> RefreshPlan:
    """The next runs of the refresh; see the module docstring.

    ``trained_shards``: family -> the shards its promoted recipe trained on, when the recipe names none (every
    shard with a cache); default every materialized shard."""
    plan = RefreshPlan()
    work = shard_work(current, materialized)
    for shard, assets in work.items():
        stage = STAGE_OF[assets[0]]
        plan.shard_runs.append(ShardRun(shard, stage, tuple(a for a in assets if STAGE_OF[a] == stage)))
    every_shard = sorted({s for asset in SHARD_CHAIN for s in materialized.get(asset, {})})
    for fam in families:
        fresh = [name for name, versions in sorted(fam.drafter_versions.items())
                 if all(versions.get(a) == current.get(a) for a in DRAFTER_ASSETS)]
        if fam.refresh_recipe in fresh or (fam.refresh_recipe is None and fresh):
            plan.refreshed[fam.family] = fam.refresh_recipe or fresh[-1]
            continue
        shards = list(fam.promoted_recipe.get("partitions") or (trained_shards or {}).get(fam.family)
                      or every_shard)
        stale = [s for s in shards if s in work]
        if stale:
            plan.waiting.append(f"{fam.family}: retrains once its shards are fresh; stale: {', '.join(stale)}")
            continue
        if fam.refresh_recipe is None:
            plan.register.append(next_recipe(fam.promoted_recipe, fam.family, fam.recipes))  # trained next tick
        else:
            plan.train.append(fam.refresh_recipe)
    return plan
