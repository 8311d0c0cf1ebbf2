"""Train and evaluate another drafter recipe on a finished demo's Dagster home, reusing its cache.

After ``python -m dagster_project.demo [--target smollm2] --home HOME``, this registers a recipe
that differs from the demo's (``dflash_assets.demo.demo_recipe`` over every shard but the last) only in
the fields given, materializes ``drafter_checkpoint`` and ``drafter_eval`` for it in the same
instance and store, and prints one JSON object: the recipe, the wall time, and the two assets'
scalar metadata (steps, final loss, tau, lossless, ...). The demo's completions, samples and
hidden-state cache are read, not rebuilt.

    .venv/bin/python bench/retrain_recipe.py --home /tmp/sm/home1 --set name=demo-e12 epochs=12 \\
        --target "$(.venv/bin/python -m dflash_assets.embedded.smollm2)"

Reads: the home's instance and store. Writes: the new recipe, its checkpoint and its evaluation
into that store (and its runs into that instance).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--home", required=True, help="the demo's Dagster home")
    ap.add_argument("--set", nargs="+", required=True, metavar="FIELD=VALUE",
                    help="recipe fields to change (values read as JSON, else as text); name= is required")
    ap.add_argument("--target", default=None, help="target model dir (default: the embedded tiny target)")
    ap.add_argument("--eval-prompts", type=int, default=16)
    ap.add_argument("--eval-new-tokens", type=int, default=64)
    args = ap.parse_args()

    overrides = {}
    for item in args.set:
        field, _, value = item.partition("=")
        try:
            overrides[field] = json.loads(value)
        except json.JSONDecodeError:
            overrides[field] = value
    if "name" not in overrides:
        ap.error("--set needs name=<new recipe name>: the demo's own recipe keeps its name")

    home = Path(args.home).resolve()
    os.environ["DAGSTER_HOME"] = str(home)
    os.environ.setdefault("DFLASH_STORE", str(home / "dflash-store"))
    import dagster as dg

    from dagster_project.definitions import defs
    from dagster_project.demo import QUIET_CONSOLE, demo_recipe
    from dagster_project.deployment import get_profile, store_for_profile
    from dagster_project.partitions import register_recipe
    from dagster_project.resources import TargetModelResource, deployment_resource

    with dg.DagsterInstance.get() as instance:
        shards = sorted(instance.get_dynamic_partitions("prompt_shards"))
        recipe = dataclasses.replace(demo_recipe(shards), **overrides)
        store = store_for_profile(get_profile())
        register_recipe(instance, store.open(), recipe)
        resources = {**defs.resources, "store": deployment_resource(store)}
        if args.target:
            resources["target"] = deployment_resource(TargetModelResource(model_path=args.target, dtype="float32"))
        t0 = time.time()
        result = dg.materialize(
            defs.assets, selection=["drafter_checkpoint", "drafter_eval"], partition_key=recipe.name,
            instance=instance, resources=resources, raise_on_error=False,
            run_config={**QUIET_CONSOLE, "ops": {"drafter_eval": {"config": {
                "num_prompts": args.eval_prompts, "max_new_tokens": args.eval_new_tokens}}}})
        out = {"recipe": recipe.to_dict(), "ok": result.success, "wall_s": round(time.time() - t0, 1)}
        for asset in ("drafter_checkpoint", "drafter_eval"):
            for m in result.asset_materializations_for_node(asset):
                values = {k: getattr(v, "value", v) for k, v in m.metadata.items()}
                out[asset] = {k: v for k, v in values.items() if isinstance(v, (int, float, str, bool))}
    print(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
