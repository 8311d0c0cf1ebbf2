"""The one action of a refresh after the target changed: ``target_refresh_sensor``.

1. The policy (``dflash_assets.drafter.refresh``) on plain values: which shard stages are stale, the order, when
   the family's next recipe is registered and trained, when it is done.
2. The weights are in the target's identity: one weight changed in place (same path, same config.json) gives
   other code versions.
3. The whole chain with two tiny targets that differ (the tiny dense target, and a copy with one weight changed):
   the demo's graph materialized on A up to a promoted drafter; the deployment switched to B; the sensor ticked
   and every run it requests executed in process on the same instance until it requests nothing. Then the
   shards are regenerated under B, ``demo-v2`` (init_from promoted) is registered and trained warm-started, and
   the ``promotion`` check compared old and new tau on the same held-out prompts.
"""

from __future__ import annotations

import importlib
import os
import shutil
import time
from pathlib import Path

import pytest

from dflash_assets.drafter.recipe import DrafterRecipe
from dflash_assets.drafter.refresh import FamilyState, family_states, next_recipe, plan_refresh, shard_work

NEW = {"completions": "1-new", "tokenized_samples": "1-newt", "hidden_state_cache": "1-newh",
       "drafter_checkpoint": "1-newd", "drafter_eval": "1-newe"}
OLD = {k: v.replace("new", "old") for k, v in NEW.items()}


def mats(versions: dict[str, str], shards: list[str], t0: float = 0.0) -> dict:
    return {a: {s: (versions[a], t0 + i) for s in shards}
            for i, a in enumerate(("completions", "tokenized_samples", "hidden_state_cache"))}


def test_family_states_keep_promoted_families_and_report_unreadable_recipes():
    recipes = {"demo-v1": DrafterRecipe(name="demo-v1"), "demo-v2": DrafterRecipe(name="demo-v2"),
               "solo-v1": DrafterRecipe(name="solo-v1", partitions=["s1"])}
    promoted = {"demo": {"recipe": "demo-v1"}}

    def load(name: str) -> DrafterRecipe:
        if name == "broken":
            raise ValueError("not a recipe")
        return recipes[name]

    warnings: list[str] = []
    drafter = {"drafter_checkpoint": {"demo-v1": ("1-oldd", 1.0)}, "drafter_eval": {"demo-v1": ("1-olde", 2.0)}}
    states, trained = family_states([*recipes, "broken"], load, promoted.get, mats(OLD, ["s0", "s2"]), drafter,
                                    {"demo": "demo-v2"}, warnings.append)
    assert warnings == ["recipe broken: cannot read it (not a recipe); left out of the refresh"]
    (state,) = states  # solo has no promoted drafter: not part of the refresh
    assert (state.family, state.recipes, state.refresh_recipe) == ("demo", ("demo-v1", "demo-v2"), "demo-v2")
    assert state.promoted_recipe == recipes["demo-v1"].to_dict()
    assert state.drafter_versions == {"demo-v1": {"drafter_checkpoint": "1-oldd", "drafter_eval": "1-olde"},
                                      "demo-v2": {}}
    assert trained == {"demo": ["s0", "s2"]}  # the promoted recipe names no shards: every cached one


def test_stale_shards_go_stage_by_stage_and_the_family_waits_for_its_trained_shards():
    family = FamilyState("demo", {"name": "demo-v1", "partitions": ["s0"], "epochs": 3}, ("demo-v1",),
                         {"demo-v1": {"drafter_checkpoint": OLD["drafter_checkpoint"], "drafter_eval": OLD["drafter_eval"]}})
    materialized = mats(OLD, ["s0", "s1"])
    plan = plan_refresh(NEW, materialized, [family])
    assert [(r.shard, r.stage, r.assets) for r in plan.shard_runs] == [
        ("s0", "prepare", ("completions", "tokenized_samples")), ("s1", "prepare", ("completions", "tokenized_samples"))]
    assert not plan.register and plan.waiting and not plan.done
    # s0 regenerated: completions and samples fresh and newer than the cache, which is now to redo
    materialized["completions"]["s0"] = (NEW["completions"], 10.0)
    materialized["tokenized_samples"]["s0"] = (NEW["tokenized_samples"], 11.0)
    assert shard_work(NEW, materialized)["s0"] == ["hidden_state_cache"]
    plan = plan_refresh(NEW, materialized, [family])
    assert ("s0", "hidden_states", ("hidden_state_cache",)) in [(r.shard, r.stage, r.assets) for r in plan.shard_runs]
    # s0 fresh: the family's next recipe is registered and trained, though s1 (held out) is still being refreshed
    materialized["hidden_state_cache"]["s0"] = (NEW["hidden_state_cache"], 12.0)
    plan = plan_refresh(NEW, materialized, [family])
    assert plan.register == [{"name": "demo-v2", "partitions": ["s0"], "epochs": 3, "init_from": "promoted"}]
    assert plan.train == [] and [r.shard for r in plan.shard_runs] == ["s1"]
    # registered (the cursor says so): trained on the next tick, and again until its drafter assets are current
    registered = FamilyState("demo", family.promoted_recipe, ("demo-v1", "demo-v2"), family.drafter_versions,
                             "demo-v2")
    assert plan_refresh(NEW, materialized, [registered]).train == ["demo-v2"]
    done = FamilyState("demo", family.promoted_recipe, ("demo-v1", "demo-v2"),
                       {**family.drafter_versions, "demo-v2": {"drafter_checkpoint": NEW["drafter_checkpoint"],
                                                               "drafter_eval": NEW["drafter_eval"]}}, "demo-v2")
    fresh = mats(NEW, ["s0", "s1"])
    assert plan_refresh(NEW, fresh, [done]).done
    assert plan_refresh(NEW, fresh, [done]).refreshed == {"demo": "demo-v2"}


def test_a_shard_redoes_what_follows_a_newer_upstream_and_never_materialized_shards_are_left_alone():
    materialized = mats(NEW, ["s0"])
    materialized["completions"]["s0"] = (NEW["completions"], 99.0)  # regenerated after the samples were made
    assert shard_work(NEW, materialized) == {"s0": ["tokenized_samples", "hidden_state_cache"]}
    assert shard_work(NEW, {}) == {}
    assert plan_refresh(NEW, mats(NEW, ["s0"]), []).done  # no promoted drafter: fresh shards are all there is


def test_next_recipe_numbers_past_every_registered_recipe_of_the_family():
    promoted = {"name": "demo-v2", "partitions": ["a"], "init_from": None, "family": None}
    assert next_recipe(promoted, "demo", ["demo-v1", "demo-v2", "demo-v7", "other-v9"])["name"] == "demo-v8"
    assert next_recipe({"name": "base", "family": None}, "base", ["base"]) == {"name": "base-v2", "family": None,
                                                                                "init_from": "promoted"}
    assert next_recipe({"name": "x-v1", "family": "fam"}, "fam", [])["name"] == "fam-v2"


def test_one_weight_changed_in_place_changes_the_targets_identity_and_the_code_versions(tiny_dense_target, tmp_path):
    from tests.drafter.test_target_change import code_versions

    from dflash_assets.target_model.spec import TargetModelSpec, weights_sample

    target = tmp_path / "target"
    shutil.copytree(tiny_dense_target, target)
    spec = TargetModelSpec(model_path=str(target), dtype="float32")
    before, fingerprint = code_versions({"DFLASH_TARGET_MODEL": str(target)}), spec.config_fingerprint()
    sample = weights_sample(str(target))
    assert [name for name, _, _ in sample] == ["model.safetensors"]
    weights = target / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # one byte of the last tensor's data, same size, same path, same config.json
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(time.time_ns(), time.time_ns()))
    assert weights_sample(str(target)) != sample and spec.config_fingerprint() != fingerprint
    after = code_versions({"DFLASH_TARGET_MODEL": str(target)})
    for name in ("completions", "tokenized_samples", "hidden_state_cache", "drafter_checkpoint", "drafter_eval"):
        assert before[name] != after[name], name


# -- the whole chain ---------------------------------------------------------------------------------------------

ASSET_MODULES = ("dagster_project.assets.prompts", "dagster_project.assets.generation",
                 "dagster_project.assets.tokenization", "dagster_project.assets.hidden_states",
                 "dagster_project.assets.drafter", "dagster_project.definitions")


@pytest.fixture
def deployment(monkeypatch, tmp_path):
    """``switch(target)``: the deployment's environment names ``target`` (float32, the in-process engine) and the
    code location is loaded again, as a restart after changing ``DFLASH_TARGET_*`` does. Restored afterwards."""
    for key in [k for k in os.environ if k.startswith(("DFLASH_TARGET_", "DFLASH_ENGINE_"))]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("DFLASH_PROFILE", "local")
    monkeypatch.setenv("DFLASH_STORE", str(tmp_path / "store"))

    def switch(target: Path):
        monkeypatch.setenv("DFLASH_TARGET_MODEL", str(target))
        monkeypatch.setenv("DFLASH_TARGET_DTYPE", "float32")
        monkeypatch.setenv("DFLASH_ENGINE_URLS", f"transformers:inprocess://{target.name}")
        for name in ASSET_MODULES:
            importlib.reload(importlib.import_module(name))
        return importlib.import_module("dagster_project.definitions").defs

    yield switch
    monkeypatch.undo()
    for name in ASSET_MODULES:
        importlib.reload(importlib.import_module(name))


def latest(instance, asset: str, partition: str):
    import dagster as dg

    records = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset),
                                                                    asset_partitions=[partition]), limit=1).records
    return records[0].asset_materialization if records else None


@pytest.mark.slow
def test_one_sensor_refreshes_the_demo_graph_after_the_target_changed(tiny_dense_target, tmp_path, deployment):
    import dagster as dg

    from dagster_project.demo import QUIET_CONSOLE, demo_run_config, run_demo
    from dagster_project.sensors import REFRESH_TAG, build_target_refresh_sensor
    from dflash_assets.drafter.promotion import read_promoted
    from dflash_assets.drafter.stages import load_recipe
    from dflash_assets.store.backends import LocalStore
    from tests.drafter.test_target_change import with_one_weight_changed

    target_a = tmp_path / "target-a"
    shutil.copytree(tiny_dense_target, target_a)
    target_b = with_one_weight_changed(target_a, tmp_path / "target-b")
    store = LocalStore(tmp_path / "store")
    eval_config = {"num_prompts": 2, "max_new_tokens": 16}

    with dg.instance_for_test() as instance:
        defs_a = deployment(target_a)
        summary = run_demo(instance, prompts=8, shard_size=4, max_new_tokens=24, max_turns=1, eval_prompts=2,
                           eval_new_tokens=16, target=str(target_a), engine="inprocess", engine_concurrency=8,
                           pilot_prompts=0)
        assert summary.ok, summary.failures
        assert read_promoted(store, "demo")["recipe"] == "demo-v1"
        shards = summary.shards
        hashes_a = {s: set(store.read_parquet(f"completions/{s}.parquet").column("config_hash").to_pylist())
                    for s in shards}
        versions_a = {a: defs_a.resolve_assets_def(a).code_versions_by_key[dg.AssetKey(a)]
                      for a in ("completions", "hidden_state_cache", "drafter_eval")}

        defs_b = deployment(target_b)  # the target changed: a fine-tune, one weight
        sensor = build_target_refresh_sensor(run_config={
            "prepare_data_job": {**demo_run_config(24, 1), **QUIET_CONSOLE},
            "hidden_states_job": QUIET_CONSOLE,
            "refresh_drafter_job": {"ops": {"drafter_eval": {"config": eval_config},  # demo-v1 passed its preflight
                                            "drafter_checkpoint": {"config": {"preflight": False}}},
                                    **QUIET_CONSOLE}})
        defs = dg.Definitions(assets=defs_b.assets, resources=defs_b.resources, jobs=defs_b.jobs, sensors=[sensor])

        def tick(cursor):  # as the daemon evaluates a tick: the code location's resources, partitions loaded
            with dg.build_sensor_context(instance=instance, cursor=cursor, definitions=defs,
                                         resources=dict(defs_b.resources)) as context, \
                    dg.partition_loading_context(dynamic_partitions_store=instance):
                return sensor.evaluate_tick(context)
        current = {a: defs.resolve_assets_def(a).code_versions_by_key[dg.AssetKey(a)]
                   for a in ("completions", "tokenized_samples", "hidden_state_cache", "drafter_checkpoint",
                             "drafter_eval")}
        assert all(current[a] != versions_a[a] for a in versions_a)

        cursor, steps, results = None, [], {}
        for _ in range(10):
            data = tick(cursor)
            cursor = data.cursor
            for request in data.dynamic_partitions_requests or []:
                instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
            if not data.run_requests and not data.dynamic_partitions_requests:
                break
            for request in data.run_requests:
                assert request.run_key.startswith(f"target-refresh-{request.tags[REFRESH_TAG]}-")
                steps.append(request.tags["dflash/refresh_step"])
                result = defs.resolve_job_def(request.job_name).execute_in_process(
                    run_config=request.run_config, instance=instance, partition_key=request.partition_key,
                    tags=request.tags, asset_selection=request.asset_selection, raise_on_error=False)
                results[steps[-1]] = result
        assert data.skip_message and data.skip_message.startswith("refresh done"), data.skip_message
        assert "demo by demo-v2" in data.skip_message

        # the order: every shard's data first, the cache after its samples, the drafter once its shard is fresh
        assert sorted(steps) == sorted([*(f"{s}/prepare" for s in shards), *(f"{s}/hidden_states" for s in shards),
                                        "drafter/demo-v2"])
        trained = load_recipe(store, "demo-v1").partitions
        assert steps.index("drafter/demo-v2") > max(steps.index(f"{s}/hidden_states") for s in trained)
        for shard in shards:  # regenerated under B
            for asset in ("completions", "tokenized_samples", "hidden_state_cache"):
                mat = latest(instance, asset, shard)
                assert mat.tags["dagster/code_version"] == current[asset], (asset, shard)
            hashes = set(store.read_parquet(f"completions/{shard}.parquet").column("config_hash").to_pylist())
            assert hashes and not hashes & hashes_a[shard], shard  # generated anew, none resumed from A's rows

        recipe = load_recipe(store, "demo-v2")
        assert recipe.init_from == "promoted" and recipe.partitions == trained
        assert "demo-v2" in instance.get_dynamic_partitions("drafter_recipes")
        checkpoint = latest(instance, "drafter_checkpoint", "demo-v2")
        assert checkpoint.tags["dagster/code_version"] == current["drafter_checkpoint"]
        warm = checkpoint.metadata["warm_start"].value
        assert warm["recipe"] == "demo-v1", warm
        promotion = {e.check_name: e for e in results["drafter/demo-v2"].get_asset_check_evaluations()}["promotion"]
        values = {k: getattr(v, "value", v) for k, v in promotion.metadata.items()}
        assert values["previous_recipe"] == "demo-v1" and str(values["remeasured_previous"]) == "True"
        previous, candidate = float(values["previous_tau"]), float(values["candidate_tau"])  # check metadata: text
        assert float(values["tau_delta"]) == pytest.approx(candidate - previous, abs=1e-3)

        # done: another tick requests nothing
        again = tick(cursor)
        assert not again.run_requests and again.skip_message.startswith("refresh done")
