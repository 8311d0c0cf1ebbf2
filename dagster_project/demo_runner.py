"""The embedded default, materialized end to end (what ``make demo`` runs; tests call it too).

1. Builds the tiny target (cached) and starts ``transformers serve`` on it, on 127.0.0.1.
2. Ingests the embedded ShareGPT file (all of it is read, counted and
   quarantined; ``prompts`` valid prompts are kept, ``shard_size`` per shard).
3. Per shard, one run: ``raw_prompts`` -> ``completions`` -> ``tokenized_samples``
   (with its blocking checks) -> ``hidden_state_cache``.
4. Registers the recipe ``demo-v1`` (every shard but the last; the last is
   held out) and materializes ``drafter_checkpoint`` and ``drafter_eval``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import dagster as dg

log = logging.getLogger("dflash.demo")

PER_SHARD_ASSETS = ["raw_prompts", "completions", "tokenized_samples", "hidden_state_cache"]


def demo_recipe(shards: list[str]):
    from dflash_assets.drafter.training import DrafterRecipe

    train = shards[:-1] if len(shards) > 1 else shards
    return DrafterRecipe(name="demo-v1", num_layers=2, block_size=8, epochs=3, lr=3e-3, max_anchors=64,
                         max_length=1024, partitions=tuple(train), save_every=20)


def demo_run_config(max_new_tokens: int, max_turns: int) -> dict[str, Any]:
    return {"ops": {"completions": {"config": {"max_new_tokens": max_new_tokens, "max_turns": max_turns,
                                               "seed": 0}}}}


def run_demo(instance: dg.DagsterInstance, *, prompts: int = 16, shard_size: int = 8, max_new_tokens: int = 96,
             max_turns: int = 2, engine_concurrency: int = 2, eval_prompts: int = 4,
             eval_new_tokens: int = 48, store: Any = None) -> dict[str, Any]:
    from dagster_project.definitions import defs
    from dagster_project.partitions import register_recipe
    from dagster_project.resources import EngineFleetResource
    from dflash_assets.embedded.defaults import embedded_engine_server

    server = embedded_engine_server("transformers", port=0)  # the tiny target, on 127.0.0.1
    log.info("starting the engine: %s", server.command)
    with server:
        resources = {**defs.resources, "engines": EngineFleetResource(
            endpoints=[f"openai:{server.url}"], max_concurrency=engine_concurrency)}
        if store is not None:  # a StoreResource, e.g. s3://... (tests run the whole graph on moto's S3)
            resources["store"] = store
        assets = defs.assets

        def materialize(selection, partition_key=None, run_config=None) -> dg.ExecuteInProcessResult:
            t0 = time.time()
            result = dg.materialize(assets, selection=selection, partition_key=partition_key, instance=instance,
                                    resources=resources, run_config=run_config or {}, raise_on_error=False)
            log.info("%s %s: %s in %.0f s", selection, partition_key or "", "ok" if result.success else "FAILED",
                     time.time() - t0)
            return result

        materialize(["prompt_corpus"], run_config={"ops": {"prompt_corpus": {"config": {
            "limit": prompts, "max_prompts_per_shard": shard_size}}}})
        shards = sorted(instance.get_dynamic_partitions("prompt_shards"))
        failed = [s for s in shards
                  if not materialize(PER_SHARD_ASSETS, s, demo_run_config(max_new_tokens, max_turns)).success]
        good = [s for s in shards if s not in failed]
        if not good:
            raise RuntimeError(f"every shard failed: {failed}; see the runs in the UI (make ui)")

    store = resources["store"].open()
    recipe = demo_recipe(good)
    register_recipe(instance, store, recipe)
    train = materialize(["drafter_checkpoint", "drafter_eval"], recipe.name, {"ops": {
        "drafter_eval": {"config": {"num_prompts": eval_prompts, "max_new_tokens": eval_new_tokens}}}})
    tau = None
    for m in train.asset_materializations_for_node("drafter_eval") if train.success else []:
        tau = m.metadata["tau"].value
    return {"shards": shards, "failed_shards": failed, "recipe": recipe.name, "tau": tau,
            "drafter_ok": train.success}
