"""Stage 1, prompts: read prompt sources (`sources`), normalize, deduplicate, quarantine and shard them (`ingest`)."""
