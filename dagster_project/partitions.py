"""Partitions of the asset graph.

``prompt_shards``: one partition per shard of at most 1024 prompts, registered
by the ``prompt_corpus`` ingest (and the source sensor) as new shards appear.
``drafter_recipes``: one partition per named, versioned training recipe.
"""

import dagster as dg

prompt_shards = dg.DynamicPartitionsDefinition(name="prompt_shards")
drafter_recipes = dg.DynamicPartitionsDefinition(name="drafter_recipes")
