"""Stage 1, prompts: read prompt sources (`sources`), normalize records with one turn parser (`normalization`),
quarantine bad ones with a reason (`quarantine`), shard prompts into tables and materialize them as partitions
(`shards`), keep and commit the corpus index (`corpus`); `ingest` drives one source through all of it, with the
settings in `config`."""
