"""Partitions of the asset graph.

``prompt_shards``: one partition per shard of at most 1024 prompts, registered
by the ``prompt_corpus`` ingest (and the source sensor) as new shards appear.
``drafter_recipes``: one partition per named, versioned training recipe.

Reads nothing; ``register_recipe`` writes ``drafter_recipes/<name>.json`` to the store and adds the partition to
the Dagster instance.
"""

import dagster as dg

prompt_shards = dg.DynamicPartitionsDefinition(name="prompt_shards")
drafter_recipes = dg.DynamicPartitionsDefinition(name="drafter_recipes")


def register_recipe(instance: dg.DagsterInstance, store, recipe) -> str:
    """Save ``recipe`` (a ``DrafterRecipe``) to the store and add its ``drafter_recipes`` partition."""
    from dflash_assets.drafter.stages import save_recipe

    save_recipe(store, recipe)
    if not instance.has_dynamic_partition(drafter_recipes.name, recipe.name):
        instance.add_dynamic_partitions(drafter_recipes.name, [recipe.name])
    return recipe.name
